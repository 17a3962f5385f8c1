"""The scheduler's side of a node's plan watch (scheduler/live/watch.py) against a fake core: a
standby holds a watch that waits for leadership and answers it, a heartbeat with its epoch first,
the moment it wins (and refuses one that does not wait); heartbeats first and whenever the stream
was quiet, none for a node that did not ask for them; a deposed leader's watch ended at the next
heartbeat; a node that heartbeats too seldom for the node timeout refused naming both settings."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler.live.watch import MIN_HEARTBEAT_S, node_heartbeat_problem, watch_node
from services.runtime.errors import InvalidArgument, Unavailable
from silod.v1 import allocation_pb2, plan_pb2

NODE = "n1"


class FakeLeadership:
    def __init__(self) -> None:
        self.leading, self.epoch = True, 4
        self.won = asyncio.Event()

    def describe_leader(self) -> str:
        return "this scheduler is a standby; the leader is at b:1 (epoch 5)"

    async def until_leading(self) -> None:
        if not self.leading:
            await self.won.wait()

    def win(self, epoch: int) -> None:
        self.leading, self.epoch = True, epoch
        self.won.set()


class FakeCore:
    def __init__(self) -> None:
        self.latest: plan_pb2.AllocationPlan | None = None
        self.leadership = FakeLeadership()
        self.refreshes = 0
        self._newer = asyncio.Event()

    async def refresh_latest(self, max_age_s: float = 0.0) -> None:
        self.refreshes += 1

    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan:
        return plan_pb2.NodePlan(version=plan.version, node=node, tasks=[
            plan_pb2.TaskAssignment(job_id=j.job_id) for j in plan.jobs])

    async def wait_newer(self, version: int, timeout: float, node: str | None = None) -> None:
        if self.latest is not None and self.latest.version > version:
            return
        self._newer.clear()
        try:
            await asyncio.wait_for(self._newer.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def commit(self, version: int, job: str) -> None:
        self.latest = plan_pb2.AllocationPlan(version=version, epoch=self.leadership.epoch,
                                              jobs=[plan_pb2.JobAllocation(job_id=job)])
        self._newer.set()


async def _collect(stream, into: list, stop: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + stop
    async for message in stream:
        into.append((time.monotonic(), message))
        if time.monotonic() > deadline:
            return


def test_heartbeat_first_then_plans_then_heartbeats_while_quiet() -> None:
    async def scenario() -> None:
        core = FakeCore()
        core.commit(1, "a")
        got: list[tuple[float, plan_pb2.NodePlan]] = []
        request = allocation_pb2.WatchPlanRequest(node=NODE, heartbeat_s=0.2)
        task = asyncio.ensure_future(_collect(watch_node(core, request, refresh_s=5.0, node_timeout_s=15.0), got, 1.5))
        await asyncio.sleep(0.7)
        core.commit(2, "b")
        await task
        kinds = [("beat" if m.heartbeat else m.version) for _, m in got]
        assert kinds[:2] == ["beat", 1], kinds
        assert got[0][1].epoch == 4 and got[0][1].node == NODE  # the serving leader's epoch
        assert 2 in kinds and kinds.count("beat") >= 5, kinds
        gaps = [b - a for (a, _), (b, _) in zip(got, got[1:])]
        assert max(gaps[1:]) < 0.2 + 0.5, gaps  # never quiet much longer than asked
        assert core.refreshes < 5  # the store is read every refresh_s, not at every heartbeat

    asyncio.run(scenario())


def test_a_standby_holds_a_waiting_watch_and_answers_it_when_it_wins() -> None:
    async def scenario() -> None:
        core = FakeCore()
        core.leadership.leading = False
        core.commit(7, "a")
        with pytest.raises(Unavailable, match="standby"):  # a node that does not wait (older nodes)
            await watch_node(core, allocation_pb2.WatchPlanRequest(node=NODE), refresh_s=5.0,
                             node_timeout_s=15.0).__anext__()
        got: list[tuple[float, plan_pb2.NodePlan]] = []
        request = allocation_pb2.WatchPlanRequest(node=NODE, wait_for_leadership=True)
        task = asyncio.ensure_future(_collect(watch_node(core, request, refresh_s=5.0, node_timeout_s=15.0), got, 30))
        await asyncio.sleep(0.5)
        assert got == [] and core.refreshes == 0  # held: nothing sent, nothing read
        won = time.monotonic()
        core.leadership.win(5)
        await Node.until(lambda: len(got) >= 2, 5)
        assert got[0][1].heartbeat and got[0][1].epoch == 5 and got[0][0] - won < 0.5
        assert not got[1][1].heartbeat and got[1][1].version == 7
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # Without heartbeats asked for, nothing more comes while nothing changes.
        assert all(not m.heartbeat for _, m in got[1:])

    asyncio.run(scenario())


class Node:
    @staticmethod
    async def until(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)


def test_no_heartbeats_unless_asked() -> None:
    async def scenario() -> None:
        core = FakeCore()
        core.commit(1, "a")
        got: list[tuple[float, plan_pb2.NodePlan]] = []
        stream = watch_node(core, allocation_pb2.WatchPlanRequest(node=NODE), refresh_s=0.2, node_timeout_s=15.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_collect(stream, got, 10), 1.0)
        assert [m.version for _, m in got] == [1]

    asyncio.run(scenario())


def test_a_deposed_leader_ends_its_watches_at_the_next_heartbeat() -> None:
    async def scenario() -> None:
        core = FakeCore()
        core.commit(1, "a")
        got: list[tuple[float, plan_pb2.NodePlan]] = []
        request = allocation_pb2.WatchPlanRequest(node=NODE, heartbeat_s=0.2)
        task = asyncio.ensure_future(_collect(watch_node(core, request, refresh_s=5.0, node_timeout_s=15.0), got, 30))
        await asyncio.sleep(0.3)
        core.leadership.leading = False
        lost = time.monotonic()
        with pytest.raises(Unavailable, match="leader is at b:1"):
            await asyncio.wait_for(task, 5)
        assert time.monotonic() - lost < 0.2 + 0.5

    asyncio.run(scenario())


def test_the_minimum_heartbeat_interval_is_kept() -> None:
    async def scenario() -> None:
        core = FakeCore()
        got: list[tuple[float, plan_pb2.NodePlan]] = []
        request = allocation_pb2.WatchPlanRequest(node=NODE, heartbeat_s=0.001)
        await _collect(watch_node(core, request, refresh_s=5.0, node_timeout_s=15.0), got, 0.5)
        assert len(got) <= 0.6 / MIN_HEARTBEAT_S + 2

    asyncio.run(scenario())


def test_a_node_heartbeating_too_seldom_for_the_node_timeout_is_refused() -> None:
    async def first(request: allocation_pb2.WatchPlanRequest) -> plan_pb2.NodePlan:
        return await watch_node(FakeCore(), request, refresh_s=5.0, node_timeout_s=15.0).__anext__()

    with pytest.raises(InvalidArgument) as refused:
        asyncio.run(first(allocation_pb2.WatchPlanRequest(node=NODE, heartbeat_s=1, node_heartbeat_s=6)))
    assert refused.value.field == "node_heartbeat_s"
    assert "node_timeout_s (15) must be at least 3x the node's heartbeat_s (6)" in refused.value.message
    assert asyncio.run(first(allocation_pb2.WatchPlanRequest(node=NODE, heartbeat_s=1, node_heartbeat_s=5))).heartbeat
    assert node_heartbeat_problem(0, 1) == ""  # a node that does not say (older agents, cache servers)
    with pytest.raises(InvalidArgument, match="node"):
        asyncio.run(first(allocation_pb2.WatchPlanRequest()))


def test_a_node_is_checked_against_the_leaders_node_timeout_once_it_is_known() -> None:
    """An allocation server knows the leader's node timeout only once a scheduler's feed declared
    it: a node that connects before is served, and refused at its next wake-up if the declared
    timeout is too short for its heartbeat (a default in its place refused nodes the leader admits)."""
    async def scenario(declared: float) -> list[plan_pb2.NodePlan]:
        core = FakeCore()
        core.commit(1, "a")
        timeout: list[float | None] = [None]
        got: list[plan_pb2.NodePlan] = []
        request = allocation_pb2.WatchPlanRequest(node=NODE, heartbeat_s=0.1, node_heartbeat_s=20)
        stream = watch_node(core, request, refresh_s=5.0, node_timeout_s=lambda: timeout[0])
        got.append(await stream.__anext__())
        got.append(await stream.__anext__())
        timeout[0] = declared
        deadline = time.monotonic() + 0.5
        async for message in stream:
            got.append(message)
            if time.monotonic() > deadline:
                break
        return got

    admitted = asyncio.run(scenario(60.0))
    assert admitted[0].heartbeat and admitted[1].version == 1 and len(admitted) >= 4
    with pytest.raises(InvalidArgument) as refused:
        asyncio.run(scenario(15.0))
    assert refused.value.field == "node_heartbeat_s"
    assert "node_timeout_s (15) must be at least 3x the node's heartbeat_s (20)" in refused.value.message
