"""scheduler.live.leadership.Leadership against a fake metadata stub: winning, renewing, losing,
lapsing without renewals, being deposed by a refused commit, and what a standby answers."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from scheduler.live.leadership import Leadership
from scheduler.live.servicers import require_leader
from services.runtime.errors import Unavailable
from silod.v1 import metadata_pb2


class FakeMetadata:
    def __init__(self) -> None:
        self.lease = metadata_pb2.Leadership()
        self.fail = False

    async def AcquireLeadership(self, request, timeout=None):  # type: ignore[no-untyped-def]  # noqa: N802
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        if not self.lease.holder or self.lease.holder == request.holder:
            if self.lease.holder != request.holder:
                self.lease = metadata_pb2.Leadership(holder=request.holder, address=request.address,
                                                     epoch=self.lease.epoch + 1)
            reply = metadata_pb2.Leadership(); reply.CopyFrom(self.lease); reply.held = True  # noqa: E702
            return reply
        return self.lease

    async def GetLeadership(self, request, timeout=None):  # type: ignore[no-untyped-def]  # noqa: N802
        return self.lease


def test_win_renew_lose_and_lapse() -> None:
    async def scenario() -> None:
        md = FakeMetadata()
        a = Leadership(enabled=True, address="a:1", ttl_s=1.0, renew_s=0.1, holder="a")
        b = Leadership(enabled=True, address="b:1", ttl_s=1.0, renew_s=0.1, holder="b")
        assert not a.leading
        assert await a.acquire_once(md) and a.epoch == 1 and a.changed.is_set()
        assert not await b.acquire_once(md) and b.leader_address == "a:1"
        with pytest.raises(Unavailable, match="leader is at a:1 \\(epoch 1\\)"):
            require_leader(type("Core", (), {"leadership": b})())
        require_leader(type("Core", (), {"leadership": a})())  # the leader serves
        md.fail = True  # renewals fail: the leader stops counting itself leader before the ttl ends
        assert await a.acquire_once(md)
        time.sleep(0.85)
        assert not await a.acquire_once(md)
        md.fail = False
        md.lease = metadata_pb2.Leadership(holder="", epoch=1)  # expired and free
        assert await b.acquire_once(md) and b.epoch == 2
        b.deposed("plan epoch 2 is older than the scheduler lease's epoch 3")
        assert not b.leading

    asyncio.run(scenario())


def test_step_down_shortens_the_lease() -> None:
    async def scenario() -> list[float]:
        md = FakeMetadata()
        asked: list[float] = []
        acquire = md.AcquireLeadership

        async def recording(request, timeout=None):  # type: ignore[no-untyped-def]
            asked.append(request.ttl_s)
            return await acquire(request, timeout)

        md.AcquireLeadership = recording  # type: ignore[method-assign]
        a = Leadership(enabled=True, address="a:1", ttl_s=5.0, renew_s=1.0, holder="a")
        await a.acquire_once(md)
        await a.step_down(md)
        assert not a.leading
        await a.step_down(md)  # not leading: nothing to hand back
        await Leadership(enabled=False).step_down(md)
        return asked

    assert asyncio.run(scenario()) == [5.0, 0.5]


def test_until_leading_returns_when_the_lease_is_won() -> None:
    """What a standby holds the nodes' watches on (scheduler/live/watch.py)."""
    async def scenario() -> None:
        md = FakeMetadata()
        md.lease = metadata_pb2.Leadership(holder="a", address="a:1", epoch=1)
        b = Leadership(enabled=True, address="b:1", ttl_s=1.0, renew_s=0.1, holder="b")
        assert not await b.acquire_once(md)
        held = [asyncio.ensure_future(b.until_leading()) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(h.done() for h in held)
        assert not await b.acquire_once(md)  # another renewal of a's lease: still held
        assert not any(h.done() for h in held)
        md.lease = metadata_pb2.Leadership(holder="", epoch=1)  # a's lease lapsed
        assert await b.acquire_once(md) and b.epoch == 2
        await asyncio.wait_for(asyncio.gather(*held), 1)
        await asyncio.wait_for(b.until_leading(), 1)  # leading: at once
        await asyncio.wait_for(Leadership(enabled=False).until_leading(), 1)

    asyncio.run(scenario())


def test_off_by_default_always_leads_at_epoch_0() -> None:
    off = Leadership(enabled=False)
    assert off.leading and off.epoch == 0
    off.deposed("ignored")
    assert off.leading


def test_a_scheduler_without_election_says_when_others_lead(caplog: pytest.LogCaptureFixture) -> None:
    md = FakeMetadata()
    md.lease = metadata_pb2.Leadership(holder="h", address="a:1", epoch=3)
    with caplog.at_level(logging.ERROR, logger="silod.scheduler"):
        asyncio.run(Leadership(enabled=False).check_alone(md))
    assert "start it with --leader-election" in caplog.text and "a:1" in caplog.text
