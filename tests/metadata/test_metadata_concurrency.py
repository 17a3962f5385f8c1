"""Races over real gRPC on both databases. Two servers share one database, as two processes
(or a restarted one overlapping its predecessor) would, so a winner is decided by the
database, not by anything inside one process."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from services.metadata.service import Settings
from silod.v1 import metadata_pb2 as m
from tests.metadata.metadata_harness import InProcessServer
from tests.metadata.metadata_samples import create_job, dataset_spec, objects, placement, plan, registration, training_spec
from silod.v1 import plan_pb2


@pytest.fixture
def two_servers(db_url: str) -> Iterator[tuple[InProcessServer, InProcessServer]]:
    with InProcessServer(Settings(db=db_url, log_level="warning")) as first, InProcessServer(
        Settings(db=db_url, log_level="warning", auto_migrate=False)
    ) as second:
        yield first, second


def race(servers: tuple[InProcessServer, ...], callers: int, call: Callable[[Any, int], Any]) -> list[Any]:
    """Run ``call(stub, i)`` from ``callers`` threads released at once; return results or RpcErrors."""
    barrier = threading.Barrier(callers)

    def one(index: int) -> Any:
        stub = servers[index % len(servers)].stub
        barrier.wait()
        try:
            return call(stub, index)
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(callers) as pool:
        return list(pool.map(one, range(callers)))


def codes(results: list[Any]) -> Counter[str]:
    return Counter(r.code().name if isinstance(r, grpc.RpcError) else "OK" for r in results)


def test_concurrent_plan_commits_at_one_version_have_exactly_one_winner(two_servers):
    stub = two_servers[0].stub
    stub.CommitPlan(m.CommitPlanRequest(plan=plan(1)))
    results = race(
        two_servers,
        20,
        lambda s, i: s.CommitPlan(m.CommitPlanRequest(plan=plan(2, plan_pb2.JobAllocation(job_id=f"job-{i}", placements=[placement("n1", 0)])))),
    )
    assert codes(results) == {"OK": 1, "ABORTED": 19}
    (winner,) = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert stub.GetLatestPlan(m.GetLatestPlanRequest()) == winner
    assert all(r.details().startswith("plan.version:") for r in results if isinstance(r, grpc.RpcError))
    # The losers retry at the next version: again one wins.
    assert codes(race(two_servers, 20, lambda s, i: s.CommitPlan(m.CommitPlanRequest(plan=plan(3))))) == {"OK": 1, "ABORTED": 19}


def test_concurrent_creates_with_one_request_id_make_one_job(two_servers):
    results = race(two_servers, 10, lambda s, i: create_job(s, training_spec(), request_id="same-request"))
    assert codes(results) == {"OK": 10}
    assert len({job.id for job in results}) == 1
    listed = two_servers[0].stub.ListJobs(m.ListJobsRequest()).jobs
    assert [job.id for job in listed] == [results[0].id]
    events = two_servers[1].stub.ListJobEvents(m.ListJobEventsRequest(job_id=results[0].id)).events
    assert len(events) == 1, "one job, one submission event"


def test_concurrent_transitions_from_one_state_have_one_winner(two_servers):
    job = create_job(two_servers[0].stub)
    results = race(
        two_servers,
        10,
        lambda s, i: s.TransitionJob(m.TransitionJobRequest(job_id=job.id, expected_state=1, new_state=2 if i % 2 else 7)),
    )
    assert codes(results) == {"OK": 1, "FAILED_PRECONDITION": 9}
    final = two_servers[1].stub.GetJob(m.GetJobRequest(job_id=job.id))
    assert final.state_version == 2
    assert len(two_servers[1].stub.ListJobEvents(m.ListJobEventsRequest(job_id=job.id)).events) == 2


def test_concurrent_event_appends_get_consecutive_sequences(two_servers):
    job = create_job(two_servers[0].stub)

    def append_five(stub, index):
        return [stub.AppendJobEvent(m.AppendJobEventRequest(job_id=job.id, type="note", message=f"{index}-{k}")).sequence for k in range(5)]

    results = race(two_servers, 12, append_five)
    assert codes(results) == {"OK": 12}
    assigned = sorted(seq for result in results for seq in result)
    assert assigned == list(range(2, 62))
    listed = two_servers[0].stub.ListJobEvents(m.ListJobEventsRequest(job_id=job.id)).events
    assert [e.sequence for e in listed] == list(range(1, 62))


def test_concurrent_registrations_of_one_name_have_one_winner(two_servers):
    results = race(two_servers, 8, lambda s, i: s.RegisterDataset(registration(dataset_spec("shared"), objects(200 + i))))
    assert codes(results) == {"OK": 1, "ALREADY_EXISTS": 7}
    (winner,) = [r for r in results if not isinstance(r, grpc.RpcError)]
    stored = two_servers[1].stub.GetDataset(m.GetDatasetRequest(name="shared"))
    assert stored.num_objects == winner.num_objects
    assert len(two_servers[1].stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="shared")).objects) == winner.num_objects


def test_concurrent_replacements_each_get_their_own_version(two_servers):
    two_servers[0].stub.RegisterDataset(registration(dataset_spec("busy"), objects(10)))
    results = race(two_servers, 6, lambda s, i: s.RegisterDataset(registration(dataset_spec("busy"), objects(10 + i), replace=True)))
    assert codes(results) == {"OK": 6}
    assert sorted(r.manifest_version for r in results) == [2, 3, 4, 5, 6, 7]
    final = max(results, key=lambda r: r.manifest_version)
    listing = two_servers[0].stub.ListDatasetObjects(m.ListDatasetObjectsRequest(name="busy"))
    assert (listing.manifest_version, len(listing.objects)) == (7, final.num_objects)
