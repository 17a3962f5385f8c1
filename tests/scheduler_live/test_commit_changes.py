"""A round's plan goes to the metadata store as what it changes of the plan in force
(CommitPlanChanges, scheduler.plan_changes); the whole plan to a metadata service without it."""

from __future__ import annotations

import asyncio

import grpc

from scheduler.live.clients import Clients
from scheduler.live.commit import Committer
from scheduler.live.plans import PlanStore
from scheduler.live.jobs import KnownJobs
from scheduler.live.releases import ReleaseTracker
from scheduler.live.resizes import CrashRestarts
from services.metadata.store.plans import apply_changes
from silod.v1 import plan_pb2


class FakeMetadata:
    """Keeps the latest plan whole, as the store does, and records what each commit sent."""

    def __init__(self, changes_supported: bool = True, header_only_supported: bool = True) -> None:
        self.changes_supported = changes_supported
        self.header_only_supported = header_only_supported  # False: an older one, which answers whole plans
        self.latest: plan_pb2.AllocationPlan | None = None
        self.sent: list[tuple[str, int]] = []  # (method, entries sent)

    async def CommitPlan(self, request):  # noqa: N802
        self.sent.append(("CommitPlan", len(request.plan.jobs)))
        self.latest = request.plan
        return request.plan

    async def CommitPlanChanges(self, request):  # noqa: N802
        if not self.changes_supported:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "")
        assert self.latest is not None and request.changes.base_version == self.latest.version
        self.sent.append(("CommitPlanChanges", len(request.changes.jobs) + len(request.changes.removed_job_ids)))
        self.latest = apply_changes(self.latest, request.plan, request.changes.jobs, request.changes.removed_job_ids)
        self.latest.created_at.FromMicroseconds(1_700_000_000_000_000 + self.latest.version)  # as stored
        if request.header_only and self.header_only_supported:
            header = plan_pb2.AllocationPlan()
            header.CopyFrom(self.latest)
            del header.jobs[:]
            return header
        return self.latest


def _plan(version: int, placed: dict[str, str]) -> plan_pb2.AllocationPlan:
    plan = plan_pb2.AllocationPlan(version=version, policy="fifo", reason=f"round {version}")
    for job, node in placed.items():
        plan.jobs.add(job_id=job, placements=[plan_pb2.GpuPlacement(node=node, gpu_indices=[0])], generation=1)
    return plan


def _rounds(md: FakeMetadata) -> list[plan_pb2.AllocationPlan]:
    async def scenario() -> list[plan_pb2.AllocationPlan]:
        clients = Clients(md=md)
        plans = PlanStore(clients)
        committer = Committer(clients, plans, ReleaseTracker(), CrashRestarts(), lambda reason: None, KnownJobs(clients))
        placed = {f"job-{i:012x}": f"n{i}" for i in range(50)}
        committed = [await committer.commit(_plan(1, placed), None, {}, "arrival")]
        placed["job-000000000007"] = "n99"  # one moves, one ends, one starts
        del placed["job-000000000009"]
        placed["job-0000000000ff"] = "n98"
        sent = _plan(2, placed)
        committed.append(await committer.commit(sent, plans.latest, {}, "completion"))
        # Answered with the header, the committed plan is the one sent, stamped as stored.
        assert (committed[-1] is sent) == (md.changes_supported and md.header_only_supported)
        assert await committer.commit(_plan(3, placed), plans.latest, {}, "interval") is None  # nothing changed
        assert committed[-1] == md.latest and committed[-1] == plans.latest
        assert {j.job_id: j.placements[0].node for j in committed[-1].jobs} == placed
        return committed

    return asyncio.run(scenario())


def test_a_round_sends_only_what_it_changes() -> None:
    md = FakeMetadata()
    _rounds(md)
    assert md.sent == [("CommitPlan", 50), ("CommitPlanChanges", 3)]


def test_an_older_metadata_service_gets_whole_plans() -> None:
    md = FakeMetadata(changes_supported=False)
    _rounds(md)
    assert md.sent == [("CommitPlan", 50), ("CommitPlan", 50)]


def test_a_metadata_service_that_answers_whole_plans_to_header_only_requests_still_works() -> None:
    md = FakeMetadata(header_only_supported=False)
    _rounds(md)
    assert md.sent == [("CommitPlan", 50), ("CommitPlanChanges", 3)]


def test_a_round_rereads_the_plan_in_force_as_its_header_and_keeps_its_own() -> None:
    class Store:
        def __init__(self) -> None:
            self.latest = _plan(4, {"job-000000000001": "n1"})
            self.asked: list[int] = []

        async def GetLatestPlan(self, request):  # noqa: N802
            self.asked.append(request.known_version)
            if request.known_version == self.latest.version:
                return plan_pb2.AllocationPlan(version=self.latest.version)  # the header
            return self.latest

    async def scenario() -> None:
        md = Store()
        plans = PlanStore(Clients(md=md))
        first = await plans.refresh()
        assert first is md.latest and md.asked == [0]
        assert await plans.refresh() is first and md.asked == [0, 4]  # the same plan: the one held stays
        md.latest = _plan(5, {"job-000000000001": "n2"})  # another scheduler committed
        assert (await plans.refresh()).version == 5 and plans.latest.jobs[0].placements[0].node == "n2"

    asyncio.run(scenario())
