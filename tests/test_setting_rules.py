"""Settings that cannot work together are refused, naming both settings, their values and the rule
(docs/configuration.md, "Settings that must agree"): at load for a pair within one process, the
process exiting 2 with one line and no traceback; and across processes, the scheduler's node
timeout against a worker agent's heartbeat interval, refused when the agent watches its plans,
the agent exiting 2 naming both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.settings import ConfigError, load_settings
from tests.support.procs import free_port, start_service


def _load(module: str, **settings: object) -> object:
    import importlib

    return load_settings(importlib.import_module(module).Settings, **settings)


@pytest.mark.parametrize("module, settings, message", [
    ("scheduler.service", {"metadata_address": "m:1", "leader_election": True, "lease_ttl_s": 2},
     "lease_ttl_s (2) must be at least 3x lease_renew_s (1): the leader must renew at least twice"),
    ("scheduler.service", {"metadata_address": "m:1", "leader_election": True, "lease_ttl_s": 5, "lease_renew_s": 2},
     "lease_ttl_s (5) must be at least 3x lease_renew_s (2)"),
    ("worker_agent.service", {"watch_heartbeat_s": 1, "watch_timeout_s": 2},
     "watch_timeout_s (2) must be at least 3x watch_heartbeat_s (1)"),
    ("worker_agent.service", {"watch_timeout_s": 4}, "watch_timeout_s (4) needs watch_heartbeat_s"),
    ("cache_server.service", {"watch_timeout_s": 1, "watch_heartbeat_s": 0.5},
     "watch_timeout_s (1) must be at least 3x watch_heartbeat_s (0.5)"),
    ("cache_server.service", {"lease_default_s": 7200}, "lease_max_s (3600) must be at least lease_default_s (7200)"),
])
def test_a_pair_that_cannot_work_is_refused_naming_both(module: str, settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(module, **settings)
    assert str(refused.value).startswith(message), str(refused.value)


@pytest.mark.parametrize("module, settings", [
    ("scheduler.service", {"metadata_address": "m:1", "leader_election": True}),  # 5 s and 1 s
    ("scheduler.service", {"metadata_address": "m:1", "leader_election": True, "lease_ttl_s": 3, "lease_renew_s": 1}),
    ("scheduler.service", {"metadata_address": "m:1", "lease_ttl_s": 1}),  # no election: the lease is not used
    ("worker_agent.service", {}),
    ("worker_agent.service", {"watch_timeout_s": 0, "watch_heartbeat_s": 10}),  # 0: no silence rule at all
    ("worker_agent.service", {"watch_heartbeat_s": 1}),  # heartbeats without a timeout: asked for none
    ("cache_server.service", {"watch_heartbeat_s": 1, "watch_timeout_s": 3, "lease_default_s": 3600}),
])
def test_pairs_that_work_are_accepted(module: str, settings: dict[str, object]) -> None:
    _load(module, **settings)


def _silod(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "silod.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


@pytest.mark.parametrize("argv, message", [
    (("scheduler", "--metadata-address", "127.0.0.1:1", "--leader-election", "--lease-ttl-s", "2"),
     "silod scheduler: configuration error: lease_ttl_s (2) must be at least 3x lease_renew_s (1): "),
    (("worker-agent", "--metadata-address", "127.0.0.1:1", "--watch-heartbeat-s", "1", "--watch-timeout-s", "2"),
     "silod worker-agent: configuration error: watch_timeout_s (2) must be at least 3x watch_heartbeat_s (1): "),
    (("cache-server", "--lease-default-s", "7200"),
     "silod cache-server: configuration error: lease_max_s (3600) must be at least lease_default_s (7200): "),
])
def test_the_process_exits_2_with_one_line(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    done = _silod(*argv, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_agent_heartbeating_too_seldom_for_the_schedulers_node_timeout_exits_2(tmp_path: Path) -> None:
    metadata = start_service("metadata", "--db", f"sqlite:///{tmp_path / 'md.db'}", "--log-level", "warning",
                             workdir=tmp_path / "metadata")
    scheduler = None
    try:
        scheduler = start_service("scheduler", "--metadata-address", metadata.address, "--node-timeout-s", "6",
                                  "--log-level", "warning", workdir=tmp_path / "scheduler", timeout_s=60)
        agent = ["worker-agent", "--listen", f"127.0.0.1:{free_port()}", "--metadata-address", metadata.address,
                 "--scheduler-address", scheduler.address, "--node-name", "slow", "--work-dir", str(tmp_path / "agent"),
                 "--gpus", "1", "--log-level", "error"]
        slow = _silod(*agent, "--heartbeat-s", "3", cwd=tmp_path)
        assert slow.returncode == 2, slow.stdout + slow.stderr
        last = slow.stderr.strip().splitlines()[-1]
        assert last.startswith(f"silod worker-agent: configuration error: heartbeat_s (3): refused by the scheduler "
                               f"at {scheduler.address}: the scheduler's node_timeout_s (6) must be at least 3x the "
                               "node's heartbeat_s (3)"), slow.stderr
        assert "Traceback" not in slow.stderr
        # At 2 s (a third of the node timeout) the same agent is served: it runs until stopped.
        ok = subprocess.Popen([sys.executable, "-m", "silod.cli", *agent, "--heartbeat-s", "2"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                ok.wait(8)
        finally:
            ok.terminate()
            ok.communicate(timeout=60)
    finally:
        if scheduler is not None:
            scheduler.close()
        metadata.close()


def test_the_fleet_refuses_a_watch_timeout_under_3_heartbeats() -> None:
    done = subprocess.run([sys.executable, "-m", "worker_agent.fleet", "--nodes", "1", "--metadata-address", "m:1",
                           "--scheduler-address", "s:1", "--watch-heartbeat-s", "1", "--watch-timeout-s", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--watch-timeout-s (2) must be at least 3x --watch-heartbeat-s (1)" in done.stderr
