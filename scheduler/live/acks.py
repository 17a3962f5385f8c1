"""Plan acks recorded in the metadata store as the node's heartbeat (its applied plan version),
written after the Ack is answered.

An Ack is answered once the scheduler has taken it in (releases, the acked-version metric);
the store's copy of the node's applied version follows from here: the newest version per
node, each node written at most once per ``every_s`` (the servicer uses a third of the node
timeout, the heartbeat interval it implies, and 5 s at least), at most ``concurrency`` writes in
flight. Each is a write transaction of about 1 ms of the metadata service's CPU, so with a
thousand nodes acking a plan every second or two these writes were most of its work; the
store's copy is for display (``silod nodes``, the dashboard) and proof of life, which the
node's own heartbeats (carrying the same version) give too. Nothing is lost by a crash in
between.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import grpc

from silod.v1 import metadata_pb2

_log = logging.getLogger("silod.scheduler")


class AckForwarder:
    def __init__(self, metadata: Callable[[], Any], concurrency: int = 16, every_s: float = 5.0) -> None:
        self._metadata = metadata  # the stub, read at each write (set once the server's loop runs)
        self._concurrency = concurrency
        self._pending: dict[str, int] = {}  # node -> newest acked version not yet written
        self._written_at: dict[str, float] = {}  # node -> monotonic time of its last write
        self._every_s = every_s
        self._task: asyncio.Task[None] | None = None

    def add(self, node: str, version: int) -> None:
        self._pending[node] = max(version, self._pending.get(node, 0))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())

    async def flush(self) -> None:
        """Until every ack taken in so far is written (or its write failed and was logged); up
        to ``every_s`` for a node written just before."""
        while self._task is not None and not self._task.done():
            await self._task

    async def _drain(self) -> None:
        gate = asyncio.Semaphore(self._concurrency)

        async def write(node: str, version: int) -> None:
            async with gate:
                try:
                    await self._metadata().Heartbeat(
                        metadata_pb2.HeartbeatRequest(node=node, applied_plan_version=version))
                except grpc.aio.AioRpcError as exc:  # the agent's next heartbeat or ack refreshes it
                    if _already_newer(exc):  # the node's own heartbeat wrote a newer version first
                        return
                    _log.warning("heartbeat forward failed", extra={
                        "node": node, "version": version, "code": exc.code().name, "details": exc.details()})

        while self._pending:
            now = time.monotonic()
            due = {n: v for n, v in self._pending.items() if now - self._written_at.get(n, -math.inf) >= self._every_s}
            if not due:  # every pending node was written less than every_s ago
                wait = min(self._written_at[n] for n in self._pending) + self._every_s - now
                await asyncio.sleep(max(wait, 0.01))
                continue
            for node in due:
                del self._pending[node]
                self._written_at[node] = now
            await asyncio.gather(*(write(node, version) for node, version in due.items()))


def _already_newer(exc: grpc.aio.AioRpcError) -> bool:
    """The store holds a newer applied version for the node than this ack's: its own heartbeat,
    which carries the same versions, got there first (hundreds a run at 1,000 nodes): nothing to
    write, nothing wrong."""
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "must not decrease" in (exc.details() or "")
