"""Epoch fencing on the nodes: a worker agent (a real process) and a cache server's plan watcher
refuse a plan from an older scheduler-leadership epoch than the newest they have seen (a deposed
leader that comes back cannot act), Acking it ok=False with the reason. The metadata store's
side (CommitPlan refusing an older epoch) is tests/metadata/test_leadership.py."""

from __future__ import annotations

from pathlib import Path

from tests.cache_server.harness import InProcessCache, quota
from tests.cache_server.test_plan_watch import acks, plan, quota_of
from tests.worker_agent.conftest import allocation, assignment, metadata, node_plan, start_agent, wait_until  # noqa: F401
from tests.worker_agent.scripted_allocation import AllocationServer

MIB = 1 << 20


def test_agent_refuses_a_plan_from_an_older_epoch(allocation, start_agent) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    agent = start_agent()
    first = node_plan(agent.node, 1, assignment("job-e", 0, 1, [0], budget=40, step_s=0.01))
    first.epoch = 2
    allocation.push(first)
    wait_until(lambda: [(a.version, a.ok) for a in allocation.servicer.acks] == [(1, True)], what="ack of v1")
    stale = node_plan(agent.node, 2, assignment("job-x", 0, 1, [1], budget=40, step_s=0.01))
    stale.epoch = 1  # a deposed leader's plan, even with a newer version
    allocation.push(stale)
    wait_until(lambda: len(allocation.servicer.acks) == 2, what="ack of the stale plan")
    refused = allocation.servicer.acks[1]
    assert (refused.version, refused.ok) == (2, False) and "epoch 1 is older than epoch 2" in refused.message
    newer = node_plan(agent.node, 2, assignment("job-e", 0, 1, [0], budget=40, step_s=0.01))
    newer.epoch = 3
    allocation.push(newer)
    wait_until(lambda: [(a.version, a.ok) for a in allocation.servicer.acks][-1] == (2, True), what="ack of v2")
    assert agent.log("job-x", 0) == ""  # the stale plan's task never launched


def test_cache_watcher_refuses_a_plan_from_an_older_epoch(tmp_path: Path) -> None:
    alloc = AllocationServer()
    cache = InProcessCache(tmp_path, "127.0.0.1:1", scheduler_address=alloc.address)
    try:
        first = plan(1, quota("J", "ds", 2 * MIB))
        first.epoch = 2
        alloc.push(first)
        wait_until(lambda: acks(alloc.servicer) == [(1, True)], what="ack of v1")
        stale = plan(2, quota("J", "ds", 4 * MIB))
        stale.epoch = 1
        alloc.push(stale)
        wait_until(lambda: len(alloc.servicer.acks) == 2, what="ack of the stale plan")
        assert acks(alloc.servicer)[1] == (2, False) and "older than epoch 2" in alloc.servicer.acks[1].message
        assert quota_of(cache, "J") == 2 * MIB
        newer = plan(2, quota("J", "ds", 4 * MIB))
        newer.epoch = 2
        alloc.push(newer)
        wait_until(lambda: quota_of(cache, "J") == 4 * MIB, what="v2 from the current epoch")
    finally:
        cache.stop()
        alloc.stop()
