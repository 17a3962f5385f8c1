"""services.runtime.batching.Coalescer: nothing waits to fill a batch, what arrives while a call
is in flight makes the next one, each item keeps its own outcome, a failed or short call fails
its items, and a cancelled sender leaves nobody waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.runtime.batching import Coalescer


class _Sender:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.release = asyncio.Event()

    async def send(self, items: Sequence[int]) -> list[int | BaseException]:
        self.calls.append(list(items))
        await self.release.wait()
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


def test_a_lone_item_goes_at_once_and_later_ones_make_the_next_call() -> None:
    async def run():
        sender = _Sender()
        calls = Coalescer(sender.send, max_items=2)
        first = asyncio.ensure_future(calls.submit(0))
        await asyncio.sleep(0.01)
        assert sender.calls == [[0]]  # sent without waiting for company
        later = [asyncio.ensure_future(calls.submit(i)) for i in (2, 3, 4)]
        await asyncio.sleep(0.01)
        sender.release.set()
        results = await asyncio.gather(first, *later, return_exceptions=True)
        return sender.calls, results

    sent, results = asyncio.run(run())
    assert sent == [[0], [2, 3], [4]]  # max_items per call
    assert results[0] == 0 and results[1] == 20 and results[3] == 40
    assert isinstance(results[2], ValueError) and str(results[2]) == "odd 3"  # its own outcome only


def test_a_failed_or_short_call_fails_every_item_of_it() -> None:
    async def failing(items: Sequence[int]) -> list[int]:
        raise ConnectionError("down")

    async def short(items: Sequence[int]) -> list[int]:
        return [1]

    async def run(send):  # type: ignore[no-untyped-def]
        calls = Coalescer(send, max_items=10)
        return await asyncio.gather(calls.submit(1), calls.submit(2), return_exceptions=True)

    assert all(isinstance(r, ConnectionError) for r in asyncio.run(run(failing)))
    assert all(isinstance(r, RuntimeError) and "1 outcomes for 2 items" in str(r) for r in asyncio.run(run(short)))


@pytest.mark.parametrize("stopped", [None, lambda in_flight: LookupError("in flight" if in_flight else "queued")])
def test_a_cancelled_sender_leaves_nobody_waiting(stopped) -> None:  # type: ignore[no-untyped-def]
    async def run():
        sender = _Sender()
        tasks: list[asyncio.Future] = []

        def spawn(call):  # type: ignore[no-untyped-def]
            tasks.append(asyncio.ensure_future(call))
            return tasks[-1]

        calls = Coalescer(sender.send, max_items=10, spawn=spawn, stopped=stopped)
        in_flight = asyncio.ensure_future(calls.submit(0))
        await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(calls.submit(2))
        await asyncio.sleep(0.01)
        assert sender.calls == [[0]]
        tasks[0].cancel()
        return await asyncio.wait_for(asyncio.gather(in_flight, queued, return_exceptions=True), 5)

    in_flight, queued = asyncio.run(run())
    if stopped is None:
        assert isinstance(in_flight, asyncio.CancelledError) and isinstance(queued, asyncio.CancelledError)
    else:
        assert (str(in_flight), str(queued)) == ("in flight", "queued")
