"""Plan acks recorded in the metadata store as the node's heartbeat (its applied plan version),
written after the Ack is answered.

An Ack is answered once the scheduler has taken it in (releases, the acked-version metric);
the store's copy of the node's applied version follows from here, newest version per node
only, at most ``concurrency`` writes in flight. With a thousand nodes acking every plan, the
agents no longer wait for a thousand metadata writes, and a store that lags behind a burst
of plans writes each node once, not once per plan. Nothing is lost by a crash in between: the
node's own heartbeats carry the same version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from silod.v1 import metadata_pb2

_log = logging.getLogger("silod.scheduler")


class AckForwarder:
    def __init__(self, metadata: Callable[[], Any], concurrency: int = 16) -> None:
        self._metadata = metadata  # the stub, read at each write (set once the server's loop runs)
        self._concurrency = concurrency
        self._pending: dict[str, int] = {}  # node -> newest acked version not yet written
        self._task: asyncio.Task[None] | None = None

    def add(self, node: str, version: int) -> None:
        self._pending[node] = max(version, self._pending.get(node, 0))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())

    async def flush(self) -> None:
        """Until every ack taken in so far is written (or its write failed and was logged)."""
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
                    _log.warning("heartbeat forward failed", extra={
                        "node": node, "version": version, "code": exc.code().name, "details": exc.details()})

        while self._pending:
            batch, self._pending = self._pending, {}
            await asyncio.gather(*(write(node, version) for node, version in batch.items()))
