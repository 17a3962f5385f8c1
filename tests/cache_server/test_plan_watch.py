"""``silod cache-server --scheduler-address``: the plan watcher against the scripted
AllocationService (tests/worker_agent/scripted_allocation.py). Quotas are observed through
the server's Stats RPC, acknowledgements through what the double recorded."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.v1 import allocation_pb2, allocation_pb2_grpc, plan_pb2
from tests.cache_server.harness import InProcessCache, quota
from tests.support.inprocess import InProcessServer
from tests.worker_agent.scripted_allocation import AllocationServer, ScriptedAllocation

NODE = "test-node"
MIB = 1 << 20
CACHE = allocation_pb2.PLAN_COMPONENT_CACHE_SERVER


def wait_until(predicate: Callable[[], Any], timeout: float = 8.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def plan(version: int, *quotas: plan_pb2.JobCacheQuota) -> plan_pb2.NodePlan:
    return plan_pb2.NodePlan(node=NODE, version=version, cache_quotas=list(quotas))


def quota_of(cache: InProcessCache, job: str) -> int:
    try:
        return cache.stats(job).jobs[0].quota_bytes
    except grpc.RpcError:
        return -1


def acks(servicer: ScriptedAllocation) -> list[tuple[int, bool]]:
    return [(a.version, a.ok) for a in list(servicer.acks)]


class AllocationAt(InProcessServer):
    """The scripted AllocationService bound to a given address (a restarted scheduler)."""

    def __init__(self, address: str) -> None:
        self.servicer = ScriptedAllocation()

        def register(server: Any) -> None:
            allocation_pb2_grpc.add_AllocationServiceServicer_to_server(self.servicer, server)

        super().__init__(
            ServiceDefinition(name="allocation-double", service_names=["silod.v1.AllocationService"], register=register),
            ServiceSettings(log_level="warning", listen=address),
            thread_name="allocation-double-2",
        )

    def push(self, p: plan_pb2.NodePlan) -> None:
        self.submit(self.servicer.push(p))


def test_no_scheduler_address_means_best_effort(tmp_path: Path) -> None:
    with InProcessCache(tmp_path, "127.0.0.1:1") as cache:
        assert "watcher" not in cache.definition.state
        assert cache.stats().plan_version == 0


def test_cache_server_follows_the_plan(tmp_path: Path) -> None:
    alloc = AllocationServer()
    second: AllocationAt | None = None
    cache = InProcessCache(tmp_path, "127.0.0.1:1", scheduler_address=alloc.address)
    try:
        watcher = cache.definition.state["watcher"]
        capacity = cache.core.capacity
        # v1 reaches the core; acked ok
        alloc.push(plan(1, quota("J", "ds", 2 * MIB)))
        wait_until(lambda: quota_of(cache, "J") == 2 * MIB, what="J's quota from v1")
        wait_until(lambda: acks(alloc.servicer) == [(1, True)], what="ack of v1")
        assert alloc.servicer.acks[0].component == CACHE and alloc.servicer.acks[0].node == NODE
        assert alloc.servicer.watch_requests[0].component == CACHE
        assert alloc.servicer.watch_requests[0].known_version == 0

        # the same version again (on the open stream, and after a reconnect) is applied once
        alloc.push(plan(1, quota("J", "ds", 2 * MIB)))
        alloc.drop_watchers()
        wait_until(lambda: len(alloc.servicer.watch_requests) >= 2, what="re-watch")
        assert alloc.servicer.watch_requests[1].known_version == 1

        # a newer version replaces the quota
        alloc.push(plan(2, quota("J", "ds", 4 * MIB), quota("K", "ds", MIB)))
        wait_until(lambda: quota_of(cache, "J") == 4 * MIB, what="J's quota from v2")
        assert quota_of(cache, "K") == MIB
        wait_until(lambda: (2, True) in acks(alloc.servicer), what="ack of v2")
        assert acks(alloc.servicer) == [(1, True), (2, True)]
        assert watcher.applied_versions == [1, 2]
        assert cache.stats().plan_version == 2

        # over capacity: acked ok=False with the reason, previous quotas stay
        alloc.push(plan(3, quota("J", "ds", capacity + 1)))
        wait_until(lambda: len(alloc.servicer.acks) == 3, what="ack of v3")
        refused = alloc.servicer.acks[2]
        assert (refused.version, refused.ok) == (3, False)
        assert "capacity" in refused.message
        assert quota_of(cache, "J") == 4 * MIB and cache.stats().plan_version == 2
        assert watcher.refused_versions == [3]

        # the AllocationService goes away: the cache keeps serving
        address = alloc.address
        alloc.stop()
        alloc = None  # type: ignore[assignment]
        time.sleep(1.0)
        assert quota_of(cache, "J") == 4 * MIB
        assert cache.stats().node == NODE

        # ... and comes back (same address) with a newer plan: the watcher reconnects
        second = AllocationAt(address)
        second.push(plan(4, quota("J", "ds", 3 * MIB)))
        wait_until(lambda: quota_of(cache, "J") == 3 * MIB, timeout=10, what="J's quota from v4 after reconnect")
        wait_until(lambda: acks(second.servicer) == [(4, True)], what="ack of v4")  # type: ignore[union-attr]
        assert second.servicer.watch_requests[0].known_version == 3
        assert quota_of(cache, "K") == -1 or quota_of(cache, "K") == 0  # K left the plan
        assert watcher.applied_versions == [1, 2, 4]
    finally:
        cache.stop()
        for server in (alloc, second):
            if server is not None:
                server.stop()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v"])
