"""The node fleet (worker_agent/fleet.py) against real metadata and scheduler processes: 50
emulated nodes register, heartbeat, watch and ack every plan that changes their part; their ranks report and finish, so
jobs run to completion, one of them across two nodes. Then `silod up --fleet` runs a cluster of
fleet nodes only. Bad flags are refused naming the flag."""

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

from scheduler.live import convert
from silod.launcher import start_service
from silod.rpc.channels import open_channel
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, plan_pb2, scheduler_pb2, scheduler_pb2_grpc
from worker_agent.fleet import FleetProcess, FleetSettings, start_fleet

NODES = 50


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, FleetProcess]]:
    work = tmp_path_factory.mktemp("fleet")
    with start_service("metadata", "--db", f"sqlite:///{work / 'm.db'}", "--log-level", "warning",
                       workdir=work) as md:
        with start_service("scheduler", "--metadata-address", md.address, "--interval-s", "1",
                           "--log-level", "warning", workdir=work) as sch:
            fleet = start_fleet(FleetSettings(nodes=NODES, gpus=8, metadata_address=md.address,
                                              scheduler_address=sch.address, heartbeat_s=1, report_s=0.3,
                                              task_seconds=1.0), work / "fleet", timeout_s=60)
            try:
                yield md.address, sch.address, fleet
            finally:
                assert fleet.terminate() == 0, fleet.log()[-3000:]


def _until(condition, what: str, timeout_s: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _submit(stub: scheduler_pb2_grpc.JobServiceStub, name: str, gpus: int) -> str:
    return stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
        name=name, application="cifar10", min_gpus=gpus, max_gpus=gpus, batch_size=128, epochs=1))).id


def test_fleet_nodes_register_watch_ack_and_run_jobs_to_completion(cluster: tuple[str, str, FleetProcess]) -> None:
    md_address, sch_address, fleet = cluster
    with open_channel(md_address) as md_channel, open_channel(sch_address) as sch_channel:
        md = metadata_pb2_grpc.MetadataServiceStub(md_channel)
        jobs = scheduler_pb2_grpc.JobServiceStub(sch_channel)
        alive = md.ListNodes(metadata_pb2.ListNodesRequest(alive_only=True, liveness_window_s=10)).nodes
        assert sorted(n.spec.name for n in alive) == sorted(f"fleet-{i}" for i in range(NODES))
        assert all(n.spec.gpus == 8 for n in alive)

        ids = [_submit(jobs, f"small-{i}", 2) for i in range(3)] + [_submit(jobs, "two-nodes", 16)]
        done = _until(lambda: all(md.GetJob(metadata_pb2.GetJobRequest(job_id=i)).state
                                  == common_pb2.JOB_STATE_SUCCEEDED for i in ids),
                      "every job succeeds on fleet nodes", timeout_s=90)
        assert done
        for job_id in ids:  # it ran: RUNNING came from its ranks' reports, progress from rank 0
            events = md.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=job_id)).events
            assert any("ranks of generation" in e.message for e in events), [e.message for e in events]
            assert md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id)).progress.samples_done > 0
        # The jobs' state moves before the round that takes them off their nodes commits: wait for
        # that plan, the last one here to change the nodes' parts.
        def without_the_jobs():  # type: ignore[no-untyped-def]
            latest = md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest())
            return latest if not any(j.job_id in ids and j.placements for j in latest.jobs) else None
        plan = _until(without_the_jobs, "a plan without the ended jobs")
        wide = [j for j in md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100)).plans
                for j in j.jobs if j.job_id == ids[-1] and len({p.node for p in j.placements}) == 2]
        assert wide, "the 16-GPU job spanned two 8-GPU fleet nodes"

        # Every node watched and acked the newest plan that changed its part (a node is sent
        # those only); the store has each node's acked version.
        due = _newest_changes(md, [f"fleet-{i}" for i in range(NODES)])
        assert max(due.values()) == plan.version  # the last plan (its jobs ended) changed some

        def all_acked() -> bool:
            acked: dict[str, int] = {}
            for version, times in fleet.stats().get("plans", {}).items():
                for node in times.get("acked", {}):
                    acked[node] = max(acked.get(node, 0), int(version))
            return all(acked.get(node, 0) >= version for node, version in due.items())
        _until(all_acked, "every node acks the newest plan that changed its part")
        _until(lambda: all(n.applied_plan_version >= due[n.spec.name] for n in md.ListNodes(
            metadata_pb2.ListNodesRequest()).nodes), "the store records every node's acked version")
        # The fleet writes its stats every second: what it said before the last plan may be read.
        _until(lambda: fleet.stats()["running_tasks"] == 0, "the fleet's tasks all ended", timeout_s=10)


def _newest_changes(md: metadata_pb2_grpc.MetadataServiceStub, nodes: list[str]) -> dict[str, int]:
    """Node -> the newest plan version whose part for it differs from the plan before (its first
    plan when none did): what the scheduler's Watch sends it last."""
    plans = sorted(md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100)).plans, key=lambda p: p.version)
    assert plans and plans[0].version == 1, "every plan since the first is listed"
    due = {node: plans[0].version for node in nodes}
    before: dict[str, plan_pb2.NodePlan] = {}
    for plan in plans:
        views = convert.node_plans(plan, {}, {})
        for node in nodes:
            view = views.get(node) or plan_pb2.NodePlan(version=plan.version, node=node, epoch=plan.epoch)
            if node in before and not convert.same_node_part(view, before[node]):
                due[node] = plan.version
            before[node] = view
    return due


def test_fleet_gpus_are_reused_after_their_jobs_end(tmp_path: Path) -> None:
    """More work than GPUs: each GPU is handed on only once the node proves it free, which for a
    task that exited (and was forgotten) before the plan took its job away is the node's next,
    empty, task report."""
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'm.db'}", "--log-level", "warning",
                       workdir=tmp_path) as md:
        with start_service("scheduler", "--metadata-address", md.address, "--interval-s", "1",
                           "--log-level", "warning", workdir=tmp_path) as sch:
            fleet = start_fleet(FleetSettings(nodes=2, gpus=2, metadata_address=md.address,
                                              scheduler_address=sch.address, heartbeat_s=1, report_s=0.3,
                                              task_seconds=0.5), tmp_path / "fleet", timeout_s=60)
            try:
                with open_channel(md.address) as md_channel, open_channel(sch.address) as sch_channel:
                    md_stub = metadata_pb2_grpc.MetadataServiceStub(md_channel)
                    ids = [_submit(scheduler_pb2_grpc.JobServiceStub(sch_channel), f"two-{i}", 2) for i in range(6)]
                    _until(lambda: all(md_stub.GetJob(metadata_pb2.GetJobRequest(job_id=i)).state
                                       == common_pb2.JOB_STATE_SUCCEEDED for i in ids),
                           "six 2-GPU jobs succeed, three at a time at most, on 4 GPUs", timeout_s=60)
            finally:
                assert fleet.terminate() == 0, fleet.log()[-3000:]


def test_fleet_refuses_bad_flags_naming_them() -> None:
    out = subprocess.run([sys.executable, "-m", "worker_agent.fleet", "--nodes", "0", "--metadata-address", "x:1",
                          "--scheduler-address", "y:1", "--report-s", "-1", "--task-spread", "1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "--nodes: must be > 0" in out.stderr and "--report-s: must be > 0" in out.stderr
    assert "--task-spread: must be >= 0 and < 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_silod_up_with_a_fleet(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    bad = subprocess.run([sys.executable, "-m", "silod.cli", "up", "--fleet", "-1", "--state-dir", str(state)],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--fleet" in bad.stderr
    up = subprocess.Popen([sys.executable, "-m", "silod.cli", "up", "--nodes", "0", "--fleet", "20",
                           "--gpus-per-node", "4", "--fleet-task-seconds", "1", "--no-dashboard", "--no-cache",
                           "--interval-s", "1", "--state-dir", str(state)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _until(lambda: (state / "cluster.json").exists() or up.poll() is not None, "cluster.json written", 120)
        assert up.poll() is None, up.stdout.read() if up.stdout else ""
        info = json.loads((state / "cluster.json").read_text())
        assert info["fleet"]["nodes"] == 20 and info["nodes"] == []
        with open_channel(info["metadata"]) as md_channel, open_channel(info["scheduler"]) as sch_channel:
            md = metadata_pb2_grpc.MetadataServiceStub(md_channel)
            nodes = md.ListNodes(metadata_pb2.ListNodesRequest(alive_only=True, liveness_window_s=10)).nodes
            assert len(nodes) == 20 and all(n.spec.gpus == 4 for n in nodes)
            job = _submit(scheduler_pb2_grpc.JobServiceStub(sch_channel), "on-the-fleet", 4)
            _until(lambda: md.GetJob(metadata_pb2.GetJobRequest(job_id=job)).state == common_pb2.JOB_STATE_SUCCEEDED,
                   "a job succeeds on the fleet of silod up", 90)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            out, _ = up.communicate()
    assert up.returncode == 0, out[-3000:]
    assert "node fleet (fleet-0..19)" in out and "20 nodes x 4 GPUs" in out


def test_task_spread_gives_every_rank_of_a_job_one_factor_and_jobs_different_ones() -> None:
    from worker_agent.fleet import _spread

    factors = [_spread(f"job-{i:012x}", 0.5) for i in range(2000)]
    assert all(0.5 <= f <= 1.5 for f in factors)
    assert _spread("job-00000000002a", 0.5) == _spread("job-00000000002a", 0.5)  # any node, any run
    assert sum(f < 0.75 for f in factors) > 300 and sum(f > 1.25 for f in factors) > 300  # spread out
    assert _spread("job-00000000002a", 0.0) == 1.0
