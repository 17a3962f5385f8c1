"""Tenant quotas live, with real `silod metadata` and `silod scheduler` processes and auth on: a
tenant's idle quota is lent to another tenant, and when the owner's demand returns, the very
next plan preempts the borrower; once the borrower's node reports it let go, the owner runs.
The test acts as the nodes' agents (registration, heartbeats, the release Ack)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from silod.v1 import allocation_pb2, allocation_pb2_grpc, common_pb2, metadata_pb2 as m, metadata_pb2_grpc
from silod.v1 import plan_pb2, scheduler_pb2, scheduler_pb2_grpc

from silod.cli import locate
from silod.cli.main import main
from silod.launcher import ServiceProcess, start_service
from silod.rpc.channels import open_channel
from tests.scheduler_live.harness import wait_for

TOKEN = "cluster-secret-for-quota-tests"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    for name in ("SILOD_AUTH_TOKEN", "SILOD_CLIENT_CONFIG", locate.LOGIN_FILE_ENV, "SILOD_METADATA_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    auth = ("--auth-token", TOKEN, "--log-level", "warning")
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'meta.db'}", *auth, workdir=tmp_path / "md") as md, \
         start_service("scheduler", "--metadata-address", md.address, "--interval-s", "600", *auth,
                       workdir=tmp_path / "sched") as scheduler:
        yield md, scheduler


def gpus(plan: plan_pb2.AllocationPlan) -> dict[str, int]:
    return {e.job_id: sum(len(p.gpu_indices) for p in e.placements) for e in plan.jobs}


def test_an_owners_returning_demand_preempts_a_borrower_in_one_round(cluster, capsys) -> None:  # type: ignore[no-untyped-def]
    md_proc, sched_proc = cluster
    md = metadata_pb2_grpc.MetadataServiceStub(open_channel(md_proc.address, token=TOKEN))
    jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(sched_proc.address, token=TOKEN))
    alloc = allocation_pb2_grpc.AllocationServiceStub(open_channel(sched_proc.address, token=TOKEN))
    for name in ("vision", "speech"):
        assert main(["admin", "tenant", "create", name, "--metadata", md_proc.address, "--token", TOKEN]) == 0
    assert main(["admin", "tenant", "quota", "vision", "--gpus", "2", "--metadata", md_proc.address, "--token", TOKEN]) == 0
    assert "vision: gpus 2" in capsys.readouterr().out

    nodes = ("n1", "n2")
    for name in nodes:
        md.UpsertNode(m.UpsertNodeRequest(spec=common_pb2.NodeSpec(name=name, gpus=2, gpu_model="emulated",
                                                                   agent_address=f"{name}.local:7000")))
    stop = threading.Event()

    def beat() -> None:  # the agents' heartbeats: the nodes stay alive for the scheduler
        while not stop.is_set():
            for name in nodes:
                try:
                    md.Heartbeat(m.HeartbeatRequest(node=name))
                except grpc.RpcError as exc:  # version 0 after the test's acks: refused, yet proof of life
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
            stop.wait(1.0)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        def submit(name: str, tenant: str) -> str:
            spec = common_pb2.JobSpec(name=name, tenant=tenant, application="cifar10", min_gpus=2, max_gpus=2,
                                      batch_size=128, epochs=1)
            return jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec)).id

        def latest() -> plan_pb2.AllocationPlan:
            try:
                return md.GetLatestPlan(m.GetLatestPlanRequest())
            except grpc.RpcError as exc:  # none committed yet
                assert exc.code() == grpc.StatusCode.NOT_FOUND
                return plan_pb2.AllocationPlan()

        borrowers = [submit("s1", "speech"), submit("s2", "speech")]
        lent = wait_for(lambda: (p := latest()) and all(gpus(p).get(j) == 2 for j in borrowers) and p,
                        timeout=30, what="speech using all 4 GPUs, vision's 2 lent")
        owner = submit("v1", "vision")
        # The first plan after the owner's submission already preempts a borrower.
        reclaim = wait_for(lambda: (p := latest()).version > lent.version and p, timeout=30, what="the next plan")
        assert reclaim.version == lent.version + 1
        held = gpus(reclaim)
        preempted = [j for j in borrowers if held.get(j, 0) == 0]
        assert len(preempted) == 1, held
        # Its node lets go (the checkpoint path's release); the owner then gets its guarantee.
        entry = next(e for e in lent.jobs if e.job_id == preempted[0])
        for node in {p.node for p in entry.placements}:
            alloc.Ack(allocation_pb2.AckPlanRequest(node=node, version=reclaim.version, ok=True,
                                                    released_jobs=[preempted[0]]))
        placed = wait_for(lambda: gpus(p := latest()).get(owner) == 2 and p, timeout=30, what="vision's job placed")
        assert sum(n for j, n in gpus(placed).items() if j in borrowers) == 2
    finally:
        stop.set()
        beating.join(5)
