"""A real ``silod scheduler`` killed with SIGKILL mid-run and restarted loses and duplicates nothing."""

from __future__ import annotations

from pathlib import Path

import grpc

from silod.launcher import start_service
from silod.v1 import (
    common_pb2,
    metadata_pb2,
    metadata_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.scheduler_live.harness import wait_for


def _request(i: int) -> scheduler_pb2.SubmitJobRequest:
    return scheduler_pb2.SubmitJobRequest(
        spec=common_pb2.JobSpec(name=f"j{i}", application="cifar10", min_gpus=1, max_gpus=1, batch_size=128, epochs=1),
        client_request_id=f"req-{i}")


def test_kill_9_and_restart_keeps_jobs_and_plan_versions(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'metadata.db'}"
    with start_service("metadata", "--db", db, workdir=tmp_path / "md") as metadata:
        md_channel = grpc.insecure_channel(metadata.address)
        md = metadata_pb2_grpc.MetadataServiceStub(md_channel)
        md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(name="n1", gpus=2, gpu_model="emulated",
                                                                              agent_address="127.0.0.1:1")))
        md.Heartbeat(metadata_pb2.HeartbeatRequest(node="n1"))
        args = ("--metadata-address", metadata.address, "--interval-s", "0.5")
        scheduler = start_service("scheduler", *args, workdir=tmp_path / "s1")
        try:
            jobs = scheduler_pb2_grpc.JobServiceStub(grpc.insecure_channel(scheduler.address))
            ids = [jobs.SubmitJob(_request(i)).id for i in range(3)]

            def latest() -> metadata_pb2.AllocationPlan | None:
                try:
                    return md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest())
                except grpc.RpcError:
                    return None

            wait_for(lambda: (p := latest()) is not None and sum(bool(j.placements) for j in p.jobs) == 2,
                     what="two jobs placed")
            before = latest().version
        finally:
            scheduler.kill()
            scheduler.close()
        md.Heartbeat(metadata_pb2.HeartbeatRequest(node="n1"))
        with start_service("scheduler", *args, workdir=tmp_path / "s2") as restarted:
            jobs = scheduler_pb2_grpc.JobServiceStub(grpc.insecure_channel(restarted.address))
            assert [jobs.SubmitJob(_request(i)).id for i in range(3)] == ids  # retried submissions: no duplicates
            listed = jobs.ListJobs(metadata_pb2.ListJobsRequest()).jobs
            assert sorted(j.id for j in listed) == sorted(ids)
            md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(name="n2", gpus=1, gpu_model="emulated",
                                                                                  agent_address="127.0.0.1:2")))
            md.Heartbeat(metadata_pb2.HeartbeatRequest(node="n2"))
            # The restarted scheduler's first round may come before it sees n2: the third job is
            # placed by the round after, and its state follows the plan's commit.
            wait_for(lambda: (p := latest()) is not None and p.version > before
                     and {j.job_id for j in p.jobs if j.placements} == set(ids), timeout=15,
                     what="a newer plan placing all three jobs")
            plans = md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100)).plans
            versions = sorted(p.version for p in plans)
            assert versions[0] == 1 and versions == list(range(1, len(versions) + 1))  # continued from the latest
            wait_for(lambda: {j.state for j in jobs.ListJobs(metadata_pb2.ListJobsRequest()).jobs}
                     == {common_pb2.JOB_STATE_SCHEDULED}, timeout=15, what="every job SCHEDULED")
        md_channel.close()
