"""Calls that arrive while one is in flight go out together in the next.

Nothing waits to fill a batch: an item is sent at once when no call is in flight, and the items
that arrive meanwhile make the next call when it returns. At a thousand nodes the metadata
service's cost is per call and per transaction (its commit), not per item, so a thousand
reports a second become a few calls a second, while a lone report is not held back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    """``send(items)`` makes one call (it may split the items itself) and returns one outcome per
    item, in order: a result, or an exception for that item alone. An exception raised by
    ``send`` fails every item of its batch.

    ``spawn`` starts the task that sends (default: asyncio.ensure_future; a service passes its
    own, which cancels it when the service stops). If that task is cancelled, nobody is left
    waiting: the items of the call in flight and those queued behind it fail with
    ``stopped(True)`` and ``stopped(False)`` (default: they are cancelled)."""

    def __init__(self, send: Callable[[Sequence[T]], Awaitable[Sequence[R | BaseException]]], max_items: int, *,
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Future[None]] = asyncio.ensure_future,
                 stopped: Callable[[bool], BaseException] | None = None) -> None:
        self._send = send
        self._max_items = max_items
        self._spawn = spawn
        self._stopped = stopped
        self._queue: list[tuple[T, asyncio.Future[R]]] = []
        self._task: asyncio.Future[None] | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._task is None or self._task.done():
            self._task = self._spawn(self._drain())
        return await asyncio.shield(future)  # a caller that goes away leaves its item in the batch

    async def flush(self) -> None:
        """Until every item submitted so far is sent."""
        while self._task is not None and not self._task.done():
            await self._task

    async def _drain(self) -> None:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue[:self._max_items], self._queue[self._max_items:]
                try:
                    outcomes = list(await self._send([item for item, _ in batch]))
                except Exception as exc:  # noqa: BLE001  # every caller of the batch hears it
                    outcomes = [exc] * len(batch)
                if len(outcomes) != len(batch):
                    outcomes = [RuntimeError(f"{len(outcomes)} outcomes for {len(batch)} items")] * len(batch)
                for (_, future), outcome in zip(batch, outcomes):
                    _settle(future, outcome)
                batch = []
        except asyncio.CancelledError:
            queued, self._queue = self._queue, []
            for items, in_flight in ((batch, True), (queued, False)):
                for _, future in items:
                    if self._stopped is None:
                        future.cancel()
                    else:
                        _settle(future, self._stopped(in_flight))
            raise


def _settle(future: asyncio.Future[R], outcome: R | BaseException) -> None:
    if future.done():  # its caller went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
