"""deploy/prometheus: the alert rules pass `promtool check rules` and their unit cases
(`promtool test rules`), the compose Prometheus config is valid and scrapes every silod
process of the compose file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.observability.prometheus import require

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
COMPOSE = PROMETHEUS_DIR.parent / "compose.yaml"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("promtool"), *args], capture_output=True, text=True, timeout=120,
                          cwd=PROMETHEUS_DIR)


def test_the_alert_rules_are_valid_and_each_alert_fires_in_its_case() -> None:
    checked = _promtool("check", "rules", "alerts.yaml")
    assert checked.returncode == 0 and "SUCCESS: 8 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", "alerts.test.yaml")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    rules = {r["alert"] for g in yaml.safe_load((PROMETHEUS_DIR / "alerts.yaml").read_text())["groups"]
             for r in g["rules"]}
    cases = (PROMETHEUS_DIR / "alerts.test.yaml").read_text()
    assert all(f"alertname: {name}" in cases for name in rules), "an alert without a test case"


def test_a_broken_case_fails(tmp_path: Path) -> None:
    """The cases can fail: the same rules with a wrong expectation are refused."""
    (tmp_path / "alerts.yaml").write_text((PROMETHEUS_DIR / "alerts.yaml").read_text())
    broken = (PROMETHEUS_DIR / "alerts.test.yaml").read_text().replace("node stuck has not", "node fine has not")
    (tmp_path / "cases.yaml").write_text(broken)
    done = subprocess.run([require("promtool"), "test", "rules", "cases.yaml"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


def test_the_compose_prometheus_scrapes_every_silod_process() -> None:
    checked = _promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    scraped = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    expected = set()
    for name, service in compose.items():
        command = service.get("command") or []
        if not command or command[0] not in ("metadata", "estimator", "scheduler", "allocation", "cache-server",
                                             "worker-agent", "dashboard"):
            continue
        expected.add(f"{name}:8080" if command[0] == "dashboard" else f"{name}:9100")
    assert scraped == expected
