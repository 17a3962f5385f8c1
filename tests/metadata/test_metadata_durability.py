"""Every acknowledged write survives kill -9 of ``silod metadata`` (real processes, both databases)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from silod.v1 import metadata_pb2 as m, metadata_pb2_grpc
from tests.metadata.metadata_samples import plan, training_spec
from tests.support.procs import start_service

WRITERS = 3
LOAD_SECONDS = 1.5


@dataclass
class Acknowledged:
    """What the server said OK to, as seen by the clients."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    job_versions: dict[str, int] = field(default_factory=dict)  # job id -> state_version acknowledged
    plan_versions: set[int] = field(default_factory=set)


def write_until_the_server_dies(address: str, writer: int, acked: Acknowledged) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        latest_plan = 0
        try:
            for n in range(10**6):
                job = stub.CreateJob(m.CreateJobRequest(spec=training_spec(name=f"w{writer}-{n}"), client_request_id=f"w{writer}-{n}"))
                with acked.lock:
                    acked.job_versions[job.id] = job.state_version
                job = stub.TransitionJob(m.TransitionJobRequest(job_id=job.id, expected_state=1, new_state=2))
                with acked.lock:
                    acked.job_versions[job.id] = job.state_version
                try:
                    committed = stub.CommitPlan(m.CommitPlanRequest(plan=plan(latest_plan + 1, reason=f"w{writer}")))
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ABORTED:
                        raise
                    latest_plan = stub.GetLatestPlan(m.GetLatestPlanRequest()).version  # lost the race: catch up
                else:
                    latest_plan = committed.version
                    with acked.lock:
                        acked.plan_versions.add(committed.version)
        except grpc.RpcError as error:
            assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), error


def test_acknowledged_writes_survive_kill_9(db_url, tmp_path):
    acked = Acknowledged()
    with start_service("metadata", "--db", db_url, "--log-level", "warning", workdir=tmp_path) as first:
        writers = [
            threading.Thread(target=write_until_the_server_dies, args=(first.address, i, acked), daemon=True) for i in range(WRITERS)
        ]
        for thread in writers:
            thread.start()
        time.sleep(LOAD_SECONDS)
        first.kill()
        for thread in writers:
            thread.join(30)
            assert not thread.is_alive()
    assert len(acked.job_versions) > 10 and acked.plan_versions, "the load did not get going before the kill"
    print(f"acknowledged before kill -9: {len(acked.job_versions)} jobs, {len(acked.plan_versions)} plans")

    with start_service("metadata", "--db", db_url, "--log-level", "warning", workdir=tmp_path) as second:
        with grpc.insecure_channel(second.address) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            for job_id, version in acked.job_versions.items():
                stored = stub.GetJob(m.GetJobRequest(job_id=job_id))
                assert stored.state_version >= version, f"{job_id} lost an acknowledged transition"
            for version in acked.plan_versions:
                assert stub.GetPlan(m.GetPlanRequest(version=version)).version == version
            latest = stub.GetLatestPlan(m.GetLatestPlanRequest()).version
            assert latest >= max(acked.plan_versions)
            # Consistent, not just present: plan versions have no gaps.
            newest = [p.version for p in stub.ListPlans(m.ListPlansRequest(page_size=100)).plans]
            assert newest == list(range(latest, latest - len(newest), -1))
