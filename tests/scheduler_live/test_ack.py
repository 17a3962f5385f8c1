"""AllocationService.Ack: releases are handled before the heartbeat is forwarded (after the
answer, scheduler.live.acks), and a failed forward is logged, not raised (the releases it
carried must not be lost with it)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from scheduler.live.servicers import AllocationService
from silod.v1 import allocation_pb2


class _FakeCore:
    latest_version = 7

    def __init__(self, heartbeat_error: bool) -> None:
        self.calls: list[str] = []
        self.heartbeat_error = heartbeat_error
        core = self

        class _Metadata:
            async def Heartbeat(self, request):  # noqa: N802
                core.calls.append(f"heartbeat {request.node} v{request.applied_plan_version}")
                if core.heartbeat_error:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details="metadata down")
                return None

        self.md = _Metadata()

    def release(self, node: str, jobs) -> bool:
        self.calls.append(f"release {node} {sorted(jobs)}")
        return True

    def trigger(self, reason: str) -> None:
        self.calls.append(f"trigger {reason}")


def _ack(core: _FakeCore) -> allocation_pb2.AckPlanResponse:
    service = AllocationService(core)  # type: ignore[arg-type]
    request = allocation_pb2.AckPlanRequest(node="n1", component=allocation_pb2.PLAN_COMPONENT_WORKER_AGENT,
                                            version=3, ok=True, released_jobs=["job-a"])

    async def ack_and_flush() -> allocation_pb2.AckPlanResponse:
        reply = await service.Ack(request, None)
        await service.acks.flush()  # the store's copy is written after the answer
        return reply

    return asyncio.run(ack_and_flush())


def test_ack_handles_releases_before_forwarding_the_heartbeat() -> None:
    core = _FakeCore(heartbeat_error=False)
    reply = _ack(core)
    assert core.calls == ["release n1 ['job-a']", "trigger release", "heartbeat n1 v3"]
    assert reply.latest_version == 7


def test_a_failed_heartbeat_forward_is_logged_and_the_release_kept(caplog: pytest.LogCaptureFixture) -> None:
    core = _FakeCore(heartbeat_error=True)
    with caplog.at_level(logging.WARNING, logger="silod.scheduler"):
        reply = _ack(core)
    assert core.calls == ["release n1 ['job-a']", "trigger release", "heartbeat n1 v3"]
    assert reply.latest_version == 7
    assert any(r.getMessage() == "heartbeat forward failed" and r.node == "n1" for r in caplog.records)


def test_an_ack_older_than_the_version_the_store_holds_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    # The node's own heartbeat (same versions) may write a newer version before the forward of
    # an older ack: the store refuses the decrease, and there is nothing to say about it.
    core = _FakeCore(heartbeat_error=False)

    async def refuse(request):  # type: ignore[no-untyped-def]
        core.calls.append(f"heartbeat {request.node} v{request.applied_plan_version}")
        raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="applied_plan_version: must not decrease: node n1 already applied plan "
                                           "4, got 3")

    core.md.Heartbeat = refuse  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="silod.scheduler"):
        reply = _ack(core)
    assert core.calls == ["release n1 ['job-a']", "trigger release", "heartbeat n1 v3"]
    assert reply.latest_version == 7
    assert not [r for r in caplog.records if r.getMessage() == "heartbeat forward failed"]


def test_acks_of_one_node_are_written_at_most_once_per_period_newest_version_last() -> None:
    from scheduler.live.acks import AckForwarder

    core = _FakeCore(heartbeat_error=False)
    forwarder = AckForwarder(lambda: core.md, every_s=0.3)

    async def run() -> float:
        forwarder.add("n1", 1)
        await forwarder.flush()
        started = asyncio.get_running_loop().time()
        forwarder.add("n1", 2)
        forwarder.add("n1", 3)
        forwarder.add("n2", 1)
        await forwarder.flush()
        return asyncio.get_running_loop().time() - started

    waited = asyncio.run(run())
    assert core.calls == ["heartbeat n1 v1", "heartbeat n2 v1", "heartbeat n1 v3"]
    assert waited >= 0.25  # n1's second write waited out its period; n2's went at once
