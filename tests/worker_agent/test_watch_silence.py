"""A node's plan watches (worker_agent/node_protocol.py) when the leader goes silent (its process
frozen, its host cut off): the node watches every scheduler at once, a standby holds its watch
until it wins the lease, and the node follows it the moment it does, its acks and reports moving
with it; a standby from before that (refusing the watch) is watched again until it leads. With
heartbeats asked for, a leader's silence reopens its watch; without, a quiet scheduler is never
left; a refused setting ends the watch."""

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
BEATS = node_protocol.WatchTiming(heartbeat_s=0.2, timeout_s=0.8)


class Node:
    """follow_plans of one node over ``servers`` (their addresses in that order), recording what it gets."""

    def __init__(self, servers: list[AllocationServer], timing: node_protocol.WatchTiming = node_protocol.WatchTiming()
                 ) -> None:
        self.addresses = [s.address for s in servers]
        self.channels: list[grpc.aio.Channel] = []  # opened on the loop that follows (aio channels belong to one)
        self.schedulers = node_protocol.Schedulers([s.address for s in servers])
        self.timing = timing
        self.plans: list[tuple[float, int, int]] = []  # (monotonic, version, epoch)
        self.followed: list[tuple[str, int]] = []
        self.errors: list[str] = []

    def offer(self, plan: plan_pb2.NodePlan) -> None:
        assert not plan.heartbeat, "a heartbeat was handed over as a plan"
        self.plans.append((time.monotonic(), plan.version, plan.epoch))

    async def follow(self) -> None:
        self.channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        await node_protocol.follow_plans(
            NODE, WORKER, stubs=[allocation_pb2_grpc.AllocationServiceStub(c) for c in self.channels], known_version=lambda: max((v for _, v, _ in self.plans), default=0),
            offer=self.offer, on_error=lambda what, detail: self.errors.append(what), schedulers=self.schedulers,
            timing=self.timing, on_follow=lambda address, epoch: self.followed.append((address, epoch)))

    async def until(self, predicate, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout, f"timed out after {timeout}s waiting for {what}"
            await asyncio.sleep(0.02)
        return time.monotonic() - start

    async def run(self, scenario) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(self.follow())
        try:
            await scenario()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
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


def test_a_frozen_leaders_nodes_follow_the_standby_the_moment_it_is_elected(two_schedulers) -> None:  # type: ignore[no-untyped-def]
    leader, standby = two_schedulers
    leader.push(plan_pb2.NodePlan(node=NODE, version=1, epoch=1))
    node = Node([leader, standby])

    async def scenario() -> None:
        await node.until(lambda: node.plans, 10, "the first plan")
        assert node.schedulers.address == leader.address and node.followed == [(leader.address, 1)]
        await node.until(lambda: standby.servicer.watch_requests, 10, "the standby watched too")
        assert standby.servicer.watch_requests[0].wait_for_leadership
        leader.servicer.frozen = True  # its watch stays open and says nothing more
        await asyncio.sleep(1.0)
        standby.servicer.leader_epoch = 2
        standby.push(plan_pb2.NodePlan(node=NODE, version=2, epoch=2))
        elected = time.monotonic()
        standby.servicer.standby = False  # wins the lease: the watch it held is answered
        await node.until(lambda: any(v == 2 for _, v, _ in node.plans), 10, "the new leader's plan")
        assert node.plans[-1][0] - elected < 3.0  # at once (the double polls its own election every 20 ms)
        assert node.schedulers.address == standby.address  # acks and reports follow
        assert node.followed[-1] == (standby.address, 2)
        # Nothing was reopened: the silent leader's watch is simply no longer the leader's.
        assert len(leader.servicer.watch_requests) == 1 and len(standby.servicer.watch_requests) == 1
        assert node.errors == []

    asyncio.run(node.run(scenario))


def test_a_standby_from_before_held_watches_is_watched_again_until_it_leads(two_schedulers) -> None:  # type: ignore[no-untyped-def]
    leader, standby = two_schedulers
    standby.servicer.old = True  # refuses the watch (UNAVAILABLE) while it stands by, sends no heartbeat
    leader.push(plan_pb2.NodePlan(node=NODE, version=1, epoch=1))
    node = Node([leader, standby])

    async def scenario() -> None:
        await node.until(lambda: node.plans, 10, "the first plan")
        await node.until(lambda: len(standby.servicer.watch_requests) >= 2, 10, "the standby asked again")
        leader.servicer.frozen = True
        standby.push(plan_pb2.NodePlan(node=NODE, version=2, epoch=2))
        standby.servicer.standby = False
        elected = time.monotonic()
        await node.until(lambda: any(v == 2 for _, v, _ in node.plans), 15, "the new leader's plan")
        assert node.plans[-1][0] - elected < node_protocol.BACKOFF_MAX_S + 2  # its next try
        assert node.schedulers.address == standby.address  # its plan's epoch is the newest declared
        assert "plan watch interrupted" in node.errors

    asyncio.run(node.run(scenario))


def test_with_heartbeats_a_silent_leaders_watch_is_opened_again() -> None:
    with AllocationServer() as leader:
        leader.push(plan_pb2.NodePlan(node=NODE, version=1, epoch=1))
        node = Node([leader], BEATS)

        async def scenario() -> None:
            await node.until(lambda: node.plans, 10, "the first plan")
            await asyncio.sleep(1.0)  # heartbeats keep a quiet leader's watch
            assert len(leader.servicer.watch_requests) == 1 and node.errors == []
            assert leader.servicer.watch_requests[0].heartbeat_s == BEATS.heartbeat_s
            leader.servicer.frozen = True
            took = await node.until(lambda: "plan watch abandoned" in node.errors, 5, "the watch abandoned")
            assert took < BEATS.timeout_s + 1.0
            await node.until(lambda: len(leader.servicer.watch_requests) >= 2, 5, "the watch opened again")

        asyncio.run(node.run(scenario))


def test_a_scheduler_without_heartbeats_is_not_left_for_being_quiet() -> None:
    with AllocationServer() as old:
        old.servicer.old = True  # from before the heartbeats: a first plan, then only newer ones
        old.push(plan_pb2.NodePlan(node=NODE, version=1))
        node = Node([old], BEATS)

        async def scenario() -> None:
            await node.until(lambda: node.plans, 10, "the first plan")
            await asyncio.sleep(3 * BEATS.timeout_s)
            assert len(old.servicer.watch_requests) == 1 and node.errors == []
            old.push(plan_pb2.NodePlan(node=NODE, version=2))
            await node.until(lambda: len(node.plans) == 2, 10, "the next plan")

        asyncio.run(node.run(scenario))


def test_without_heartbeats_none_are_asked_for() -> None:
    with AllocationServer() as leader:
        leader.push(plan_pb2.NodePlan(node=NODE, version=1, epoch=1))
        node = Node([leader], node_protocol.WatchTiming(heartbeat_s=1.0, timeout_s=0))

        async def scenario() -> None:
            await node.until(lambda: node.plans, 10, "the first plan")
            asked = leader.servicer.watch_requests[0]
            assert asked.heartbeat_s == 0 and asked.wait_for_leadership  # a timeout of 0 acts on none

        asyncio.run(node.run(scenario))


def test_a_refused_setting_ends_the_watch() -> None:
    with AllocationServer() as scheduler:
        scheduler.servicer.refusal = "node_heartbeat_s: the scheduler's node_timeout_s (15) must be at least 3x ..."
        node = Node([scheduler], node_protocol.WatchTiming(node_heartbeat_s=10))

        async def scenario() -> None:
            with pytest.raises(node_protocol.WatchRefused, match="^the scheduler's node_timeout_s \\(15\\)") as refused:
                await asyncio.wait_for(node.follow(), 10)
            assert refused.value.address == scheduler.address

        asyncio.run(scenario())
        assert scheduler.servicer.watch_requests[0].node_heartbeat_s == 10.0
