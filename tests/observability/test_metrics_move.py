"""A real Prometheus scrapes a running `silod up` (the targets it writes) and PromQL sees the
scheduler's and the agents' metrics move with the cluster: rounds, a job that is submitted,
runs and ends, a node that disappears (its agent frozen: no heartbeats, no scrapes) under a
job spread over both nodes, the resize of that job to the node left, and the node's return.
How each kind of plan change is counted is checked on plans in
tests/scheduler_live/test_scheduler_metrics.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.observability.prometheus import Prometheus, prometheus_scraping, require

SMALL = ("name: small\napplication: cifar10\nmin_gpus: 1\nmax_gpus: 1\nbatch_size: 16\nsample_budget: 320\n"
         "emulated_step_compute_s: 0.02\n")
ELASTIC = ("name: elastic\napplication: cifar10\nmin_gpus: 1\nmax_gpus: 4\nbatch_size: 64\nsample_budget: 100000000\n"
           "emulated_step_compute_s: 0.05\n")


def _silod(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update({"SILOD_STATE_DIR": str(state), "SILOD_CLIENT_CONFIG": str(state / "none.yaml")})
    return subprocess.run([sys.executable, "-m", "silod.cli", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def _agent_pid(up_pid: int, node: str) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(up_pid)], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"worker-agent" in argv and node.encode() in argv:
            return pid
    raise AssertionError(f"no worker agent of {node} under silod up")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    require("prometheus")
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    # A frozen node is lost after 4 s; the agents heartbeat every second, so no live one is.
    env.update({"SILOD_NODE_TIMEOUT_S": "4", "SILOD_HEARTBEAT_S": "1"})
    up = subprocess.Popen([sys.executable, "-m", "silod.cli", "up", "--nodes", "2", "--gpus-per-node", "2",
                           "--state-dir", str(state), "--interval-s", "1", "--no-dashboard"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (state / "cluster.json").exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "cluster.json not written"
            time.sleep(0.1)
        yield up, state
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


def test_the_metrics_move_with_the_cluster(cluster: tuple[subprocess.Popen[str], Path], tmp_path: Path) -> None:
    up, state = cluster
    info = json.loads((state / "cluster.json").read_text())
    targets = json.loads(Path(info["prometheus_targets"]).read_text())
    assert {g["labels"]["job"] for g in targets} == {"silod-metadata", "silod-estimator", "silod-scheduler",
                                                     "silod-allocation", "silod-cache-server", "silod-worker-agent"}
    with prometheus_scraping(Path(info["prometheus_targets"]), tmp_path / "prometheus") as prom:
        try:
            _check(prom, up, state)
        except AssertionError as exc:  # say what the scheduler did instead
            changes = {r["metric"].get("kind"): r["value"][1] for r in prom.query("silod_scheduler_job_changes_total")}
            jobs = _silod(state, "jobs").stdout
            raise AssertionError(f"{exc}\njob changes: {changes}\n{jobs}") from None


def _check(prom: Prometheus, up: subprocess.Popen[str], state: Path) -> None:
    prom.wait_for('count(up{job=~"silod-.*"} == 1)', lambda v: v == 8, what="every process scraped")
    # A round happens: the scheduler counts it and times its phases.
    prom.wait_for("sum(silod_scheduler_rounds_total)", lambda v: v >= 1, what="rounds")
    prom.wait_for('sum(silod_scheduler_round_duration_seconds_count{phase="policy"})', lambda v: v >= 1)
    prom.wait_for("sum(silod_scheduler_policy_answers_total)", lambda v: v >= 1, what="policy answers")
    prom.wait_for('sum(silod_scheduler_gpus{state="idle"})', lambda v: v == 4, what="4 idle GPUs")

    # A job is submitted, runs and ends.
    (state / "small.yaml").write_text(SMALL)
    assert _silod(state, "submit", str(state / "small.yaml")).returncode == 0
    prom.wait_for('sum(silod_scheduler_job_changes_total{kind="started"})', lambda v: v >= 1, what="a job started")
    prom.wait_for('sum(silod_agent_rank_exits_total{cause="succeeded"})', lambda v: v >= 1, what="its rank succeeded")
    prom.wait_for("sum(silod_scheduler_plan_version)", lambda v: v >= 1)
    prom.wait_for("min(silod_scheduler_node_acked_plan_version)", lambda v: v >= 1, what="both nodes acked")
    # ... at the allocation service, which relays the acks and the task reports to the scheduler.
    prom.wait_for("silod_allocation_plan_version", lambda v: v >= 1, what="the allocation service fed")
    prom.wait_for('sum(silod_allocation_relayed_total{kind="report"})', lambda v: v >= 1, what="reports relayed")

    # A job on all 4 GPUs, half of them on node-1, which then disappears.
    (state / "elastic.yaml").write_text(ELASTIC)
    assert _silod(state, "submit", str(state / "elastic.yaml")).returncode == 0
    prom.wait_for('sum(silod_scheduler_gpus{state="allocated"})', lambda v: v == 4, what="4 GPUs allocated")
    prom.wait_for("sum(silod_agent_ranks_running)", lambda v: v == 4, what="4 ranks running")
    prom.wait_for('sum(silod_scheduler_jobs{state="RUNNING"})', lambda v: v == 1, what="1 job running")
    agent = _agent_pid(up.pid, "node-1")
    os.kill(agent, signal.SIGSTOP)  # no heartbeats, no answers to scrapes
    try:
        prom.wait_for('count(up{job="silod-worker-agent"} == 0)', lambda v: v == 1, what="node-1's agent down")
        prom.wait_for('sum(silod_scheduler_gpus{pool="training"})', lambda v: v == 2, what="node-1's GPUs gone")
        # The job keeps what is left (at least its min_gpus): a resize, from its checkpoint.
        prom.wait_for('sum(silod_scheduler_job_changes_total{kind=~"resized_.*"})', lambda v: v >= 1, what="resized")
        prom.wait_for('sum(silod_scheduler_gpus{state="allocated"})', lambda v: v == 2, what="2 GPUs allocated")
        prom.wait_for("sum(silod_scheduler_plan_version) - min(silod_scheduler_node_acked_plan_version)",
                      lambda v: v >= 1, what="the frozen node falls behind the plans")
    finally:
        os.kill(agent, signal.SIGCONT)
    # The node comes back: its agent answers and its GPUs count again.
    prom.wait_for('count(up{job="silod-worker-agent"} == 1)', lambda v: v == 2, what="node-1 back")
    prom.wait_for('sum(silod_scheduler_gpus{pool="training"})', lambda v: v == 4, what="node-1's GPUs back")
