"""docs/metrics.md is generated from the metric objects and is current; the Grafana dashboard
and the alert rules query only metrics that exist; labels stay bounded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.runtime import metrics_reference

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "silod.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
METRIC = re.compile(r"\bsilod_[a-z0-9_]+\b")


def unknown_metrics(expressions: list[str]) -> set[str]:
    exported = metrics_reference.all_exported_names()
    return {name for expr in expressions for name in METRIC.findall(expr)} - exported


def _panel_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def test_the_committed_reference_is_current() -> None:
    assert metrics_reference.REFERENCE_PATH.read_text() == metrics_reference.render(), \
        "docs/metrics.md is stale: run `make metrics-docs`"


def test_every_grafana_panel_queries_metrics_silod_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _panel_exprs(dashboard)
    assert len(exprs) >= 30 and all(METRIC.search(e) or "up{" in e for e in exprs)
    assert unknown_metrics(exprs) == set()
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert titles == {"Cluster", "Queue", "Cache", "Per node ($node)"}


def test_a_panel_on_a_metric_that_does_not_exist_is_caught() -> None:
    assert unknown_metrics(["sum(rate(silod_scheduler_rounds_total[5m]))",
                            "silod_scheduler_roundz_total"]) == {"silod_scheduler_roundz_total"}


def test_every_alert_rule_queries_metrics_silod_exports() -> None:
    rules = [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert unknown_metrics(rules) == set()


def test_labels_are_bounded() -> None:
    """No job, task or request ids as labels (docs/metrics.md says why)."""
    for process, modules in metrics_reference.PROCESSES:
        for module in modules:
            for metric in metrics_reference.metric_objects(module):
                unbounded = set(metric._labelnames) & {"job", "job_id", "task", "request_id", "rank", "pid", "dataset",
                                                       "key", "lease"}
                assert not unbounded, f"{metric._name}: labelled with {sorted(unbounded)}"
