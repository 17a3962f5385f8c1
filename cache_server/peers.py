"""Peer reads: the cache servers of a multi-node job's nodes serve each other's misses.

The plan gives a job's quota on this node the job's other nodes (``JobCacheQuota.peers``).
A miss here is first asked of their caches with ``Read(cached_only=True)``: the peer answers
from its tiers only (never from the store, never asking its own peers), so the job's content
on its nodes stays disjoint and its hit ratio is that of the union of its nodes' caches, as the
simulator models it. What no peer holds is read from the store by the caller, as before.

The concurrent misses of one job (a Lease's batch, a window of Read, the prefetch worker's
queue) are gathered for one turn of the event loop and asked in one call per peer, all peers at
once. A peer is asked with a short deadline; one that fails (down, slow, an error) is skipped
for ``cooldown_s`` so a dead node does not add its deadline to every batch. A peer never fails a
read: its keys count as not found.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from cache_server import metrics
from silod.v1 import cache_pb2, cache_pb2_grpc

_log = logging.getLogger("silod.cache.peers")

MAX_KEYS_PER_CALL = 4096  # CacheService's limit per Read
# The deadline of a peer call grows with the bytes it may return (at this rate), so a batch of
# large objects from a healthy peer is not cut off (and the peer sent to cool down) by a
# deadline meant to catch a dead one.
SLOWEST_PEER_BYTES_PER_S = 100e6


class OutdatedPeer(Exception):
    """The peer answered without etags: a server that predates ``cached_only`` (and so read
    the store for our keys). Not asked again for a long while."""

AddressLookup = Callable[[str], Awaitable[str]]
ChannelFactory = Callable[[str], Any]


@dataclass(frozen=True)
class Peer:
    node: str
    cache_address: str  # "" = ask ``lookup_address``


@dataclass
class _Wanted:
    size: int
    etag: str
    waiters: list[asyncio.Future[bytes | None]] = field(default_factory=list)


@dataclass
class _Batch:
    job_id: str
    dataset: str
    peers: tuple[Peer, ...]
    keys: dict[str, _Wanted] = field(default_factory=dict)


class PeerReader:
    """Asks the caches of a job's other nodes for objects; one per cache server."""

    def __init__(
        self,
        node: str,
        open_channel: ChannelFactory,
        lookup_address: AddressLookup | None = None,
        timeout_s: float = 1.5,
        cooldown_s: float = 5.0,
        address_ttl_s: float = 30.0,
    ) -> None:
        self.node = node
        self._open_channel = open_channel
        self._lookup_address = lookup_address
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.address_ttl_s = address_ttl_s
        self._channels: dict[str, tuple[Any, Any]] = {}  # address -> (channel, stub)
        self._addresses: dict[str, tuple[str, float]] = {}  # node -> (looked-up address, monotonic expiry)
        self._skip_until: dict[str, float] = {}  # node -> monotonic time before which it is not asked
        self._batches: dict[tuple[str, str, tuple[Peer, ...]], _Batch] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for channel, _ in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._channels.clear()

    async def read(self, job_id: str, dataset: str, peers: Sequence[Peer], key: str, size: int,
                   etag: str) -> bytes | None:
        """The object's bytes from the cache of one of ``peers``, or None (no peer holds this version)."""
        peers = tuple(p for p in peers if p.node != self.node)
        now = time.monotonic()
        if not any(self._skip_until.get(p.node, 0.0) <= now for p in peers):
            return None  # every peer failed a moment ago: straight to the store

        batch_key = (job_id, dataset, peers)
        batch = self._batches.get(batch_key)
        if batch is None:
            batch = self._batches[batch_key] = _Batch(job_id, dataset, peers)
            # The other misses of the same Lease/Read run in this turn of the loop: ask once for all.
            asyncio.get_running_loop().call_soon(self._send, batch_key)
        wanted = batch.keys.get(key)
        if wanted is None:
            wanted = batch.keys[key] = _Wanted(size, etag)
        elif wanted.etag != etag:  # two manifest versions at once: ask for the newer caller's later
            return None
        future: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        wanted.waiters.append(future)
        return await future

    def _send(self, batch_key: tuple[str, str, tuple[Peer, ...]]) -> None:
        batch = self._batches.pop(batch_key, None)
        if batch is None:
            return
        task = asyncio.ensure_future(self._ask(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask(self, batch: _Batch) -> None:
        found: dict[str, bytes] = {}
        asked: list[Peer] = []
        try:
            now = time.monotonic()
            asked = [p for p in batch.peers if self._skip_until.get(p.node, 0.0) <= now]
            keys = list(batch.keys)
            answers = await asyncio.gather(*(self._ask_peer(p, batch, keys) for p in asked))
            for answer in answers:
                for key, data in answer.items():
                    found.setdefault(key, data)
        finally:
            for key, wanted in batch.keys.items():
                data = found.get(key)
                if data is None:
                    if asked:  # not a lookup at all when every peer was skipped
                        metrics.PEER_MISSES.inc()
                else:
                    metrics.PEER_HITS.inc()
                    metrics.PEER_BYTES.inc(len(data))
                for waiter in wanted.waiters:
                    if not waiter.done():
                        waiter.set_result(data)

    async def _ask_peer(self, peer: Peer, batch: _Batch, keys: list[str]) -> dict[str, bytes]:
        """What ``peer`` holds of ``keys`` (right version and size only); {} if it fails."""
        found: dict[str, bytes] = {}
        try:
            address = await self._address(peer)
            if not address:
                raise LookupError(f"no cache address known for node {peer.node!r}")
            stub = self._stub(address)
            for start in range(0, len(keys), MAX_KEYS_PER_CALL):
                part_keys = keys[start:start + MAX_KEYS_PER_CALL]
                request = cache_pb2.ReadRequest(job_id=batch.job_id, dataset=batch.dataset, keys=part_keys,
                                                cached_only=True)
                most_bytes = sum(batch.keys[k].size for k in part_keys)
                parts: dict[str, list[bytes]] = {}
                async for chunk in stub.Read(request, timeout=self.timeout_s + most_bytes / SLOWEST_PEER_BYTES_PER_S):
                    if not chunk.etag:
                        raise OutdatedPeer("answers without etags: it does not know cached_only reads")
                    wanted = batch.keys.get(chunk.key)
                    if wanted is None or chunk.etag != wanted.etag:
                        continue  # another version than our manifest's (a re-registration under way)
                    parts.setdefault(chunk.key, []).append(chunk.data)
                    if chunk.last:
                        data = b"".join(parts.pop(chunk.key))
                        if len(data) == wanted.size:
                            found[chunk.key] = data
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer never fails the reader: its keys are misses
            what = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            cooldown = self.cooldown_s if not isinstance(exc, OutdatedPeer) else max(self.cooldown_s, 600.0)
            self._skip_until[peer.node] = time.monotonic() + cooldown
            metrics.PEER_ERRORS.labels(peer=peer.node).inc()
            _log.debug("peer cache skipped", extra={"peer": peer.node, "job_id": batch.job_id,
                                                    "dataset": batch.dataset, "error": what,
                                                    "skipped_for_s": cooldown})
            return found  # what arrived before the failure is still good
        return found

    async def _address(self, peer: Peer) -> str:
        if peer.cache_address:
            return peer.cache_address
        if self._lookup_address is None:
            return ""
        cached = self._addresses.get(peer.node)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        address = await asyncio.wait_for(self._lookup_address(peer.node), self.timeout_s)
        self._addresses[peer.node] = (address, now + self.address_ttl_s)
        return address

    def _stub(self, address: str) -> Any:
        held = self._channels.get(address)
        if held is None:
            channel = self._open_channel(address)
            held = self._channels[address] = (channel, cache_pb2_grpc.CacheServiceStub(channel))
        return held[1]
