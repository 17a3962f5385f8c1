"""``silod allocation`` (scheduler/allocation/): the nodes' Watch, Ack and ReportTasks served apart
from the rounds. Fed each committed plan by the scheduler's PlanFeedService, it serves the node parts,
relays acks and reports to the leader (job states move, releases are taken in, acked versions
reach the store), refuses bad input naming the field, and fences a deposed leader's plans."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from scheduler.allocation.follower import FeedOutOfStep, PlanFollower
from scheduler.allocation.service import Settings as AllocationSettings
from scheduler.allocation.service import definition as allocation_definition
from scheduler.live.clients import Clients
from scheduler.live.plans import PlanStore
from silod.v1 import allocation_pb2, allocation_pb2_grpc, common_pb2, metadata_pb2, plan_pb2
from tests.scheduler_live.conftest import Cluster
from tests.scheduler_live.harness import wait_for
from tests.support.inprocess import InProcessServer

AGENT = allocation_pb2.PLAN_COMPONENT_WORKER_AGENT


class AllocationServer:
    def __init__(self, cluster: Cluster, schedulers: str = "") -> None:
        settings = AllocationSettings(metadata_address=cluster.metadata.address,
                                      scheduler_address=schedulers or cluster.scheduler.address, name="alloc-test")
        self.definition = allocation_definition(settings)
        self.follower = self.definition.follower  # type: ignore[attr-defined]
        self.server = InProcessServer(self.definition, settings, thread_name="allocation-server")
        self.stub = allocation_pb2_grpc.AllocationServiceStub(self.server.channel)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def served(sqlite_url: str) -> Iterator[tuple[Cluster, AllocationServer]]:
    cluster = Cluster(sqlite_url)
    alloc = None
    try:
        alloc = AllocationServer(cluster)
        yield cluster, alloc
    finally:
        if alloc is not None:
            alloc.stop()
        cluster.close()


def _first(stub: allocation_pb2_grpc.AllocationServiceStub, node: str, version: int) -> plan_pb2.NodePlan:
    """The first plan (not heartbeat) at or after ``version`` on ``node``'s watch."""
    call = stub.Watch(allocation_pb2.WatchPlanRequest(node=node, component=AGENT, wait_for_leadership=True),
                      timeout=20)
    try:
        for message in call:
            if not message.heartbeat and message.version >= version:
                return message
    finally:
        call.cancel()
    raise AssertionError("watch ended")


def test_serves_watches_and_relays_acks_and_reports(served) -> None:  # type: ignore[no-untyped-def]
    cluster, alloc = served
    cluster.add_node("n1", gpus=2)
    job = cluster.submit("a", min_gpus=1, max_gpus=1)
    plan = cluster.round()
    assert any(e.job_id == job.id for e in plan.jobs)
    wait_for(lambda: alloc.follower.latest_version >= plan.version, what="the allocation server fed the plan")
    part = _first(alloc.stub, "n1", plan.version)
    assert [t.job_id for t in part.tasks] == [job.id] and part.tasks[0].spec.application == "cifar10"

    # Ack: answered with the plan in force; the acked version reaches the store from here.
    reply = alloc.stub.Ack(allocation_pb2.AckPlanRequest(node="n1", component=AGENT, version=part.version, ok=True))
    assert reply.latest_version == plan.version
    wait_for(lambda: cluster.md.GetNode(metadata_pb2.GetNodeRequest(node="n1")).applied_plan_version == part.version,
             what="the acked version in the store")
    # ... and the ack reaches the leader, after the answer (the scheduler runs in this process).
    from scheduler.live.metrics import NODE_ACKED

    wait_for(lambda: NODE_ACKED.labels("n1")._value.get() == part.version, what="the ack relayed to the scheduler")

    # A report moves the job's state at the leader; an exit is acknowledged.
    task = part.tasks[0]
    report = allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=task.generation,
                                       phase=allocation_pb2.TASK_PHASE_RUNNING, gpu_indices=list(task.gpu_indices))
    alloc.stub.ReportTasks(allocation_pb2.ReportTasksRequest(node="n1", applied_plan_version=part.version,
                                                             tasks=[report]))
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING
    done = allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=task.generation,
                                     phase=allocation_pb2.TASK_PHASE_EXITED, exit_code=0)
    answer = alloc.stub.ReportTasks(allocation_pb2.ReportTasksRequest(node="n1", applied_plan_version=part.version,
                                                                      tasks=[done]))
    assert list(answer.acknowledged_exits) == [f"{job.id}/0/{task.generation}"]
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SUCCEEDED

    # The next plan (the job done) reaches the watch through the feed, as changes of the one before.
    nxt = cluster.round()
    assert nxt.version > plan.version
    assert _first(alloc.stub, "n1", nxt.version).tasks == []


def test_a_nodes_new_address_reaches_the_next_plan(served) -> None:  # type: ignore[no-untyped-def]
    """An agent restarted elsewhere (a new pod IP) registers its new address: the next plan's
    node parts carry it (a rank's MASTER_ADDR), as the scheduler's own cut does; the feed sends
    it with that plan."""
    cluster, alloc = served
    cluster.add_node("n1", gpus=2)
    first = cluster.submit("a", min_gpus=1, max_gpus=1)
    plan = cluster.round()
    assert _first(alloc.stub, "n1", plan.version).tasks[0].master_addr == "n1.local"
    cluster.md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
        name="n1", gpus=2, gpu_model="emulated", agent_address="n1-moved.local:7000")))
    cluster.submit("b", min_gpus=1, max_gpus=1)
    nxt = cluster.round()
    assert nxt.version > plan.version
    part = _first(alloc.stub, "n1", nxt.version)
    assert {t.job_id for t in part.tasks} >= {first.id} and {t.master_addr for t in part.tasks} == {"n1-moved.local"}


def test_bad_input_is_refused_naming_the_field(served) -> None:  # type: ignore[no-untyped-def]
    _, alloc = served
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(alloc.stub.Watch(allocation_pb2.WatchPlanRequest(component=AGENT), timeout=10)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "node" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        alloc.stub.Ack(allocation_pb2.AckPlanRequest(node="n1", version=-1))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        alloc.stub.ReportTasks(allocation_pb2.ReportTasksRequest(node="n1", tasks=[
            allocation_pb2.TaskReport(job_id="job-x", rank=-1)]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tasks[0].rank" in refused.value.details()


def _follower() -> PlanFollower:
    class _Md:
        async def ListJobs(self, request):  # noqa: N802
            return metadata_pb2.ListJobsResponse()

        async def ListNodes(self, request):  # noqa: N802
            return metadata_pb2.ListNodesResponse()

    return PlanFollower(PlanStore(Clients(md=_Md())))  # type: ignore[arg-type]


def _plan(version: int, epoch: int, *jobs: str) -> plan_pb2.AllocationPlan:
    return plan_pb2.AllocationPlan(version=version, epoch=epoch, jobs=[
        plan_pb2.JobAllocation(job_id=j, placements=[plan_pb2.GpuPlacement(node="n1", gpu_indices=[0])]) for j in jobs])


def test_a_plan_fed_with_its_specs_and_addresses_is_served_without_asking_the_store() -> None:
    """The feed sends what the node parts need with the plan: a thousand nodes' plans do not
    wait for a ListJobs and a ListNodes first (at 1,000 nodes that wait was seconds)."""
    class _Unreachable:
        def __getattr__(self, method: str):  # type: ignore[no-untyped-def]
            async def refused(request, **kwargs):  # type: ignore[no-untyped-def]
                raise AssertionError(f"the store was asked: {method}")
            return refused

    async def run() -> None:
        f = PlanFollower(PlanStore(Clients(md=_Unreachable())))  # type: ignore[arg-type]
        f._nodes_read_at = 0.0  # as after start(): the addresses would be read again now
        spec = common_pb2.JobSpec(name="a", application="cifar10", min_gpus=1, max_gpus=1)
        where = allocation_pb2.FeedNodeAddress(node="n1", agent_address="10.0.0.7:7000", cache_address="10.0.0.7:7001")
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=1, plan=_plan(5, 1, "a"), specs={"a": spec},
                                                    node_addresses=[where]))
        part = await f.node_plan(f.latest, "n1")
        assert [(t.job_id, t.spec.application, t.master_addr) for t in part.tasks] == [("a", "cifar10", "10.0.0.7")]
        # Changes bring the specs of the jobs they add, and an address that changed.
        moved = allocation_pb2.FeedNodeAddress(node="n1", agent_address="10.0.0.9:7000")
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=1, plan=_plan(6, 1), changes=plan_pb2.PlanChanges(
            base_version=5, jobs=_plan(0, 0, "b").jobs), specs={"b": spec}, node_addresses=[moved]))
        part = await f.node_plan(f.latest, "n1")
        assert {t.job_id: t.master_addr for t in part.tasks} == {"a": "10.0.0.9", "b": "10.0.0.9"}
        # A job that leaves the plan leaves no spec behind (a long-lived server would grow with
        # every job ever run).
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=1, plan=_plan(7, 1), changes=plan_pb2.PlanChanges(
            base_version=6, removed_job_ids=["a"])))
        assert set(f.plans.specs) == {"b"}
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=1, plan=_plan(8, 1, "c"), specs={"c": spec}))
        assert set(f.plans.specs) == {"c"}

    asyncio.run(run())


def test_a_deposed_leaders_feed_is_fenced() -> None:
    async def run() -> None:
        f = _follower()
        await f.offer(allocation_pb2.PlanFeedUpdate(heartbeat=True, epoch=2, node_timeout_s=30))
        assert f.node_timeout_s == 30 and not f.leadership.leading
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=2, plan=_plan(5, 1, "a")))  # the plan in force, older epoch
        assert f.latest_version == 5 and f.leadership.leading
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=2, plan=_plan(6, 2, "b")))
        assert [j.job_id for j in f.latest.jobs] == ["b"]
        # The deposed leader (epoch 1) still streams: nothing it sends is taken in, however new.
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=1, plan=_plan(9, 1, "x")))
        assert f.latest_version == 6
        # A plan older than the newest plan epoch is refused, as the nodes refuse it.
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=3, plan=_plan(7, 1, "x")))
        assert f.latest_version == 6
        # Changes apply to the plan held; changes of another plan end the feed (opened again, whole).
        header = _plan(7, 3)
        await f.offer(allocation_pb2.PlanFeedUpdate(epoch=3, plan=header, changes=plan_pb2.PlanChanges(
            base_version=6, jobs=_plan(0, 0, "c").jobs, removed_job_ids=["b"])))
        assert f.latest_version == 7 and [j.job_id for j in f.latest.jobs] == ["c"] and f.latest.epoch == 3
        with pytest.raises(FeedOutOfStep):
            await f.offer(allocation_pb2.PlanFeedUpdate(epoch=3, plan=_plan(9, 3), changes=plan_pb2.PlanChanges(
                base_version=8)))
        assert f.latest_version == 7

    asyncio.run(run())
