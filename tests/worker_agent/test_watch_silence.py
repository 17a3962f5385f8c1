"""A node's plan watch (worker_agent/node_protocol.py) against schedulers that go silent: the
leader's heartbeats stop (its process frozen, its host cut off) and the node moves to the next
address within its watch timeout, passing the silent one over; a scheduler from before the
heartbeats is not abandoned for having nothing to say; a refused setting ends the watch."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from silod.v1 import allocation_pb2, allocation_pb2_grpc, plan_pb2
from tests.worker_agent.scripted_allocation import AllocationServer
from worker_agent import node_protocol

NODE = "n1"
WORKER = allocation_pb2.PLAN_COMPONENT_WORKER_AGENT
TIMING = node_protocol.WatchTiming(heartbeat_s=0.2, timeout_s=0.8)


class Node:
    """follow_plans of one node over ``servers`` (their addresses in that order), recording what it gets."""

    def __init__(self, servers: list[AllocationServer], timing: node_protocol.WatchTiming = TIMING) -> None:
        self.channels = [grpc.aio.insecure_channel(s.address) for s in servers]
        self.stub = allocation_pb2_grpc.AllocationServiceStub(self.channels[0])
        self.schedulers = node_protocol.Schedulers([s.address for s in servers], self._use)
        self.timing = timing
        self.plans: list[tuple[float, int, str]] = []  # (monotonic, version, address)
        self.followed: list[tuple[str, int]] = []
        self.errors: list[str] = []

    def _use(self, index: int) -> None:
        self.stub = allocation_pb2_grpc.AllocationServiceStub(self.channels[index])

    def offer(self, plan: plan_pb2.NodePlan) -> None:
        assert not plan.heartbeat, "a heartbeat was handed over as a plan"
        self.plans.append((time.monotonic(), plan.version, self.schedulers.address))

    async def follow(self) -> None:
        await node_protocol.follow_plans(
            NODE, WORKER, stub=lambda: self.stub, known_version=lambda: max((v for _, v, _ in self.plans), default=0),
            offer=self.offer, on_error=lambda what, detail: self.errors.append(what), schedulers=self.schedulers,
            timing=self.timing, on_follow=lambda address, epoch: self.followed.append((address, epoch)))

    async def until(self, predicate, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout, f"timed out after {timeout}s waiting for {what}"
            await asyncio.sleep(0.02)
        return time.monotonic() - start

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


@pytest.fixture
def two_schedulers():  # type: ignore[no-untyped-def]
    leader, standby = AllocationServer(), AllocationServer()
    standby.servicer.standby = True
    try:
        yield leader, standby
    finally:
        leader.stop()
        standby.stop()


def test_a_frozen_leader_is_left_within_the_watch_timeout_for_the_new_one(two_schedulers) -> None:  # type: ignore[no-untyped-def]
    leader, standby = two_schedulers
    leader.push(plan_pb2.NodePlan(node=NODE, version=1, epoch=1))

    async def scenario() -> None:
        node = Node([leader, standby])
        task = asyncio.ensure_future(node.follow())
        try:
            await node.until(lambda: node.plans, 10, "the first plan")
            await asyncio.sleep(1.0)  # heartbeats keep a quiet leader's watch: no reconnect
            assert len(leader.servicer.watch_requests) == 1 and node.errors == []
            leader.servicer.frozen = True  # its stream stays open and says nothing more
            frozen_at = time.monotonic()
            await asyncio.sleep(0.3)
            standby.servicer.standby = False  # elected
            standby.push(plan_pb2.NodePlan(node=NODE, version=2, epoch=2))
            await node.until(lambda: any(v == 2 for _, v, _ in node.plans), 10, "the new leader's plan")
            moved = node.plans[-1][0] - frozen_at
            assert node.plans[-1][2] == standby.address
            assert moved < TIMING.timeout_s + 1.5, f"took {moved:.2f}s"
            assert "plan watch abandoned" in node.errors
            assert node.followed[0][0] == leader.address and node.followed[-1][0] == standby.address
            # The silent one is passed over: no second watch to it while the other answered.
            assert len(leader.servicer.watch_requests) == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await node.close()

    asyncio.run(scenario())


def test_the_silent_one_is_tried_again_when_no_other_leads(two_schedulers) -> None:  # type: ignore[no-untyped-def]
    leader, standby = two_schedulers
    leader.push(plan_pb2.NodePlan(node=NODE, version=1, epoch=1))

    async def scenario() -> None:
        node = Node([leader, standby])
        task = asyncio.ensure_future(node.follow())
        try:
            await node.until(lambda: node.plans, 10, "the first plan")
            leader.servicer.frozen = True
            await node.until(lambda: "plan watch abandoned" in node.errors, 5, "the watch abandoned")
            leader.servicer.frozen = False  # it was only slow: still the leader, and the standby says so
            # Passed over for twice the timeout, then watched again (the standby refusing meanwhile).
            waited = await node.until(lambda: len(leader.servicer.watch_requests) >= 2, 10, "the leader watched again")
            assert waited > TIMING.timeout_s  # not at once
            assert len(standby.servicer.watch_requests) >= 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await node.close()

    asyncio.run(scenario())


def test_a_scheduler_without_heartbeats_is_not_left_for_being_quiet() -> None:
    with AllocationServer() as old:
        old.servicer.old = True  # from before the heartbeats: a first plan, then only newer ones
        old.push(plan_pb2.NodePlan(node=NODE, version=1))

        async def scenario() -> None:
            node = Node([old])
            task = asyncio.ensure_future(node.follow())
            try:
                await node.until(lambda: node.plans, 10, "the first plan")
                await asyncio.sleep(3 * TIMING.timeout_s)
                assert len(old.servicer.watch_requests) == 1 and node.errors == []
                old.push(plan_pb2.NodePlan(node=NODE, version=2))
                await node.until(lambda: len(node.plans) == 2, 10, "the next plan")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await node.close()

        asyncio.run(scenario())


def test_heartbeats_are_asked_for_and_a_refused_setting_ends_the_watch() -> None:
    with AllocationServer() as scheduler:
        scheduler.servicer.refusal = "node_heartbeat_s: the scheduler's node_timeout_s (15) must be at least 3x ..."

        async def scenario() -> None:
            node = Node([scheduler], node_protocol.WatchTiming(heartbeat_s=1.0, timeout_s=4.0, node_heartbeat_s=10))
            try:
                with pytest.raises(node_protocol.WatchRefused, match="node_timeout_s \\(15\\)"):
                    await asyncio.wait_for(node.follow(), 10)
            finally:
                await node.close()

        asyncio.run(scenario())
        asked = scheduler.servicer.watch_requests[0]
        assert (asked.heartbeat_s, asked.node_heartbeat_s) == (1.0, 10.0)
