"""The directories of this node's cache server that contained ranks read leased samples from.

The cache server says which (``StatsResponse.reader_paths``: its tiers, its transient files, its
local lease socket); a runtime that gives ranks a root of their own mounts them read-only, so
that the SDK's leased reads work there as they do outside. Asked at a rank's launch and kept a
while; without an answer (no cache server, or it is down) ranks get none and read through gRPC
or the store.
"""

from __future__ import annotations

import time

import grpc

from services.runtime.structured_logging import get_logger
from silod.rpc.channels import open_channel
from silod.v1 import cache_pb2, cache_pb2_grpc

_log = get_logger("silod.worker_agent")
KEEP_S = 30.0


class CachePaths:
    def __init__(self, address: str, token: str) -> None:
        self.address = address
        self._token = token
        self._channel = None
        self._paths: list[str] = []
        self._asked_at = 0.0

    async def get(self) -> list[str]:
        if not self.address:
            return []
        now = time.monotonic()
        if self._paths and now - self._asked_at < KEEP_S:
            return self._paths
        if self._channel is None:
            self._channel = open_channel(self.address, token=self._token, aio=True)
        try:
            stats = await cache_pb2_grpc.CacheServiceStub(self._channel).Stats(cache_pb2.StatsRequest(), timeout=3)
        except grpc.aio.AioRpcError as exc:
            _log.info("cache server's reader paths unknown; contained ranks read without them",
                      extra={"code": exc.code().name})
            return self._paths
        self._paths, self._asked_at = sorted(stats.reader_paths), now
        return self._paths

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
