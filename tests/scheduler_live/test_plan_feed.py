"""PlanFeedService, the scheduler's side of the allocation services: WatchPlans declares the
leader's epoch and node timeout, sends the plan in force whole (its header alone when the
follower holds it), then each newer plan as what it changes; Relay is refused by a standby and
by a scheduler at an older epoch than the caller has seen."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler.live.feed import PlanFeedService
from services.runtime.errors import FailedPrecondition, Unavailable
from silod.v1 import allocation_pb2, allocation_pb2_grpc


def test_watch_plans_sends_the_plan_whole_then_its_changes(cluster) -> None:  # type: ignore[no-untyped-def]
    feed = allocation_pb2_grpc.PlanFeedServiceStub(cluster.scheduler.channel)
    cluster.add_node("n1", gpus=2)
    a = cluster.submit("a")
    first = cluster.round()
    call = feed.WatchPlans(allocation_pb2.WatchPlansRequest(server="test"), timeout=30)
    try:
        stream = iter(call)
        beat = next(stream)
        assert beat.heartbeat and beat.epoch == 0 and beat.node_timeout_s == 15
        whole = next(stream)
        assert not whole.HasField("changes") and whole.plan.version == first.version
        assert [j.job_id for j in whole.plan.jobs] == [j.job_id for j in first.jobs]
        # With it, what the node parts need: the specs of its jobs, the nodes' addresses.
        assert set(whole.specs) == {a.id} and whole.specs[a.id].name == "a"
        assert [(n.node, n.agent_address) for n in whole.node_addresses] == [("n1", "n1.local:7000")]
        b = cluster.submit("b")
        second = cluster.round()
        update = next(stream)
        while update.plan.version < second.version:  # a round triggered by the submission may come first
            update = next(stream)
        assert update.HasField("changes") and not update.plan.jobs
        assert update.changes.base_version < second.version
        assert b.id in {j.job_id for j in update.changes.jobs} and a.id not in update.changes.removed_job_ids
        assert b.id in update.specs and a.id not in update.specs  # a's was sent with the whole plan
        assert not update.node_addresses  # unchanged: sent once on a stream
    finally:
        call.cancel()
    # A follower that holds the plan in force gets its header alone.
    call = feed.WatchPlans(allocation_pb2.WatchPlansRequest(server="test", known_version=second.version), timeout=30)
    try:
        stream = iter(call)
        assert next(stream).heartbeat
        header = next(stream)
        assert header.plan.version == second.version and not header.plan.jobs
        assert header.changes.base_version == second.version and not header.changes.jobs
    finally:
        call.cancel()


class _Leadership:
    def __init__(self, leading: bool, epoch: int) -> None:
        self.enabled, self.leading, self.epoch = True, leading, epoch

    def describe_leader(self) -> str:
        return "this scheduler is a standby"


class _Core:
    latest_version = 3

    def __init__(self, leading: bool, epoch: int) -> None:
        self.leadership = _Leadership(leading, epoch)
        self.released: list[tuple[str, list[str]]] = []

    def release(self, node, jobs) -> bool:  # type: ignore[no-untyped-def]
        self.released.append((node, list(jobs)))
        return True

    def trigger(self, reason: str) -> None:
        pass

    async def report_tasks(self, request):  # type: ignore[no-untyped-def]
        return [f"{t.job_id}/{t.rank}/{t.generation}" for t in request.tasks]


def _relay(core: _Core, epoch: int) -> allocation_pb2.RelayResponse:
    request = allocation_pb2.RelayRequest(epoch=epoch, acks=[allocation_pb2.AckPlanRequest(
        node="n1", version=3, ok=True, released_jobs=["job-a"])], reports=[
        allocation_pb2.ReportTasksRequest(node="n1", tasks=[allocation_pb2.TaskReport(
            job_id="job-a", rank=0, generation=1, phase=allocation_pb2.TASK_PHASE_EXITED)]),
        allocation_pb2.ReportTasksRequest(node="n2", tasks=[allocation_pb2.TaskReport(job_id="job-b", rank=-1)])])
    return asyncio.run(PlanFeedService(core, node_timeout_s=15).Relay(request, None))


def test_relay_takes_in_acks_and_reports_each_with_its_own_outcome() -> None:
    core = _Core(leading=True, epoch=4)
    reply = _relay(core, epoch=4)
    assert core.released == [("n1", ["job-a"])] and reply.latest_version == 3
    assert list(reply.reports[0].acknowledged_exits) == ["job-a/0/1"] and not reply.reports[0].error_code
    assert reply.reports[1].error_code == "INVALID_ARGUMENT" and "tasks[0].rank" in reply.reports[1].error


def test_relay_is_refused_by_a_standby_and_by_a_deposed_leader() -> None:
    with pytest.raises(Unavailable):
        _relay(_Core(leading=False, epoch=4), epoch=4)
    deposed = _Core(leading=True, epoch=4)  # it does not know yet: the caller saw epoch 5
    with pytest.raises(FailedPrecondition) as refused:
        _relay(deposed, epoch=5)
    assert refused.value.field == "epoch" and deposed.released == []
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
