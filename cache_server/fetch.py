"""The fetch pipeline: how a missing object version reaches the cache.

In order: a peer's cache (multi-node jobs, cache_server/peers.py: served, never admitted here),
else one fetch from the store however many readers ask at once (*single flight*), paid at the
job's IO rate (its token bucket) before it claims the flight, verified against the manifest's
version tag, then admitted (entries.py). An object the store holds in another version sends us
to the catalog once: if the dataset was re-registered with that version, it is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from cache_server import metrics
from cache_server.catalog import DatasetCatalog, DatasetState
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.jobs import JobState
from cache_server.peers import PeerReader
from cache_server.policies import PASS_THROUGH
from cache_server.ratelimit import TokenBucket
from cache_server.runtime import Runtime
from cache_server.stats import Statistics
from cache_server.tiers import Entry
from services.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable
from silod.data.store import ObjectChanged, ObjectMissing, ObjectOutsideRoot, StoreError

Flight = tuple[str, str, str]  # (dataset, key, etag): one object version
Fetched = tuple[Entry | None, bytes]  # the admitted entry (None: served without caching) and the bytes


class NoLongerWanted(Exception):
    """A prefetch whose object the job read while the prefetch waited for idle IO."""


class FetchPipeline:
    def __init__(self, config: CacheConfig, runtime: Runtime, entries: EntryStore, catalog: DatasetCatalog,
                 statistics: Statistics, peers: PeerReader | None) -> None:
        self.config = config
        self.runtime = runtime
        self.entries = entries
        self.catalog = catalog
        self.statistics = statistics
        self.peers = peers  # None: misses go to the store whatever the plan says
        self._inflight: dict[Flight, asyncio.Future[Fetched]] = {}
        # Object versions whose IO a job is paying for now (waiting in its bucket before it
        # claims the flight): the bucket and a future set once that payment is over.
        self._paying: dict[Flight, tuple[TokenBucket, asyncio.Future[None]]] = {}

    def in_flight(self, flight: Flight) -> bool:
        return flight in self._inflight

    def claim(self, flights: list[Flight]) -> list[tuple[Flight, asyncio.Future[Any]]]:
        """Register ``flights`` as fetches in flight now, for a caller that fetches them together
        (a coalesced ranged read): readers of any of them wait for those bytes. The caller sets
        each future and then calls :meth:`settle`."""
        loop = asyncio.get_running_loop()
        claimed: list[tuple[Flight, asyncio.Future[Any]]] = []
        for flight in flights:
            future: asyncio.Future[Any] = loop.create_future()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._inflight[flight] = future
            claimed.append((flight, future))
        return claimed

    def settle(self, claimed: list[tuple[Flight, asyncio.Future[Any]]]) -> None:
        """End claimed flights: their waiters get what was set, or a cancellation."""
        for flight, future in claimed:
            if not future.done():
                future.cancel()
            if self._inflight.get(flight) is future:
                del self._inflight[flight]

    async def obtain(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, data: bytes | None = None,
        background: bool = False,
    ) -> Fetched:
        """Fetch (once, however many callers ask at the same time) and admit one object version.

        ``data``: bytes already at hand (staged by prefetch); then nothing is fetched.
        ``background``: a prefetch; it pays for its bytes only when the job's IO is idle
        (``TokenBucket.acquire_when_idle``), so a reader's misses never queue behind it.
        Every admission goes through here, so one version is never written twice at once.
        """
        flight = (ds.name, key, etag)
        pending = self._inflight.get(flight)
        paid = None  # the bucket this job's IO for the object was paid on, before claiming the flight
        if pending is None and data is None:
            pending = await self._wait_for_grant(job, flight)
            if pending is None:
                pending, paid = await self._pay_before_claiming(job, flight, size, background)
        if pending is not None:
            if paid is not None:
                paid.refund(size)  # served by someone else's fetch: no IO of its own
            return await asyncio.shield(pending)
        future: asyncio.Future[Fetched] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._inflight[flight] = future
        try:
            existing = self.entries.index.get((ds.name, key))
            if data is None and existing is not None and existing.etag == etag and existing.verified \
                    and not existing.doomed:
                # Admitted by someone else since the caller looked: a local read beats a remote one.
                data = await self.entries.read_pinned(existing)
            if data is None:
                data = await self.fetch(job, ds, key, size, etag, paid=paid is not None)
            elif paid is not None:
                paid.refund(size)  # read locally after all
            entry = await self.entries.admit(job, ds.name, key, etag, data, ds.cost)
            future.set_result((entry, data))
            return entry, data
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            self._inflight.pop(flight, None)

    async def _wait_for_grant(self, job: JobState, flight: Flight) -> asyncio.Future[Fetched] | None:
        """While the job is granted no IO: wait for a grant, or for a flight or a copy that serves it."""
        pending = None
        while pending is None and job.held:
            # Granted no IO: a fetch of its own waits for a grant, outside the single-flight
            # table (a reader with IO must not wait behind it); a flight someone else starts
            # meanwhile, or a copy admitted meanwhile, serves it at no IO cost.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(job.io_granted.wait(), 0.5)
            pending = self._inflight.get(flight)
            cached = self.entries.lookup(*flight)
            if pending is None and cached is not None and cached.verified and not cached.doomed:
                break
        return pending

    async def _pay_before_claiming(self, job: JobState, flight: Flight, size: int, background: bool
                                   ) -> tuple[asyncio.Future[Fetched] | None, TokenBucket | None]:
        """Pay for the object's bytes at the job's IO rate; return the flight that serves it
        meanwhile (if any) and the bucket paid on (None: nothing paid)."""
        pending = None
        booked = self._paying.get(flight)
        if booked is not None and booked[0] is job.bucket:
            # A reader of the same job is already paying for these bytes, booked earlier in the
            # same bucket (a Lease and a Read of one object, say): wait for that payment and
            # join its flight rather than book the bytes again behind everything booked since.
            await asyncio.shield(booked[1])
            pending = self._inflight.get(flight)
        if pending is not None or job.bucket is None:
            return pending, None
        # Pay for the bytes at this job's IO rate BEFORE claiming the flight: a flight in the
        # table must be a fetch at the store's speed. Claimed first, a job granted a trickle
        # (the budget's last 1 %) made every other reader of the object wait on its bucket --
        # a co-reader granted nearly all the budget crawled at 4 samples/s behind it.
        # (So only a payer of the same job is waited for, above.)
        paid = job.bucket
        if background:
            # Prefetches book only when the job's IO is idle: booked ahead, a window of them
            # sat in the bucket and every miss a reader had to fetch itself queued behind
            # them (~0.5 s a miss in the DDP fidelity runs, a partly cached first epoch
            # running at the pace of reading and computing in turn).
            await paid.acquire_when_idle(size)
            if (flight[0], flight[1]) not in job.ahead and flight not in self._inflight:
                # The job read it (and did not keep it) while this prefetch waited for idle
                # IO: fetching it now would spend the job's IO on bytes no one reads.
                paid.refund(size)
                raise NoLongerWanted(flight[1])
        else:
            booking = (paid, asyncio.get_running_loop().create_future())
            first = self._paying.setdefault(flight, booking) is booking
            try:
                await paid.acquire(size)
            finally:
                if first:
                    # Waiters resume after this task, which claims the flight below without
                    # yielding in between, or, cancelled, never does (they pay themselves).
                    del self._paying[flight]
                    booking[1].set_result(None)
        return self._inflight.get(flight), paid

    async def fetch(self, job: JobState, ds: DatasetState, key: str, size: int, etag: str,
                    paid: bool = False) -> bytes:
        """The bytes from the store, at the job's IO rate. ``paid``: the caller already waited
        for this job's IO tokens for these bytes."""
        while job.held:  # no IO granted (pass-through jobs come here directly)
            await job.io_granted.wait()
        if job.bucket is not None and not paid:
            await job.bucket.acquire(size)
        started = time.monotonic()
        if ds.store.reads_async:  # on this loop, no thread per fetch; the client bounds each attempt
            async with self.runtime.remote_slots:
                data = await ds.store.read_async(key, size, etag)
        else:
            # The store bounds each attempt; this bounds the whole retry sequence (a hung mount).
            overall = self.config.remote_deadline_s
            try:
                async with asyncio.timeout(overall):
                    data = await self.runtime.on_remote(ds.store.read, key, size, etag)
            except TimeoutError:
                raise StoreError(f"object {key!r}: no answer from the store within {overall:g}s", key) from None
        ds.cost.observe(len(data), time.monotonic() - started)
        self.statistics.remote_read(job, len(data))
        return data

    async def _fetch_uncached(self, job: JobState, ds: DatasetState, key: str, size: int, etag: str) -> Fetched:
        """Cache policy "none": the object from the store, at the job's IO rate, admitted nowhere.

        No single flight with other readers either: sharing a fetch another job admits would
        hand this job bytes it did not pay remote IO for."""
        data = await self.fetch(job, ds, key, size, etag)
        metrics.labelled(metrics.PASS_THROUGH, PASS_THROUGH).inc()
        return None, data

    async def from_peer(self, job: JobState, ds: DatasetState, key: str, size: int, etag: str) -> bytes | None:
        """The object from the cache of one of the job's other nodes, or None: no peers, a
        pass-through job, or none of them holds this version. Not admitted here by anyone."""
        if self.peers is None or not job.peers or job.pass_through:
            return None
        if (ds.name, key, etag) in self._inflight:
            return None  # being fetched here already (a reader of the dataset without peers): join that
        return await self.peers.read(job.job_id, ds.name, job.peers, key, size, etag)

    async def get_bytes(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, where: str
    ) -> tuple[DatasetState, Entry | None, bytes, int, str, str]:
        """Obtain a missing object, following a manifest replacement once if the store changed.

        The last item says where it came from: "peer" (a peer's cache; not admitted) or "remote"."""
        obtain = self._fetch_uncached if job.pass_through else self.obtain
        from_peer = (ds.name, key) in job.staged_from_peer
        staged = job.consumed(ds.name, key)
        if staged is not None and len(staged) == size and not job.pass_through:
            if from_peer:
                return ds, None, staged, size, etag, "peer"
            entry, data = await self.obtain(job, ds, key, size, etag, staged)
            return ds, entry, data, size, etag, "remote"
        peer_data = await self.from_peer(job, ds, key, size, etag)
        if peer_data is not None:
            return ds, None, peer_data, size, etag, "peer"
        try:
            entry, data = await obtain(job, ds, key, size, etag)
            return ds, entry, data, size, etag, "remote"
        except ObjectChanged as exc:
            fresh = await self.catalog.reload_for_change(ds)
            pos = fresh.manifest.index.get(key)
            if pos is None or fresh.manifest.etags[pos] == etag:
                raise store_error(exc, ds, where) from None
            size, etag = fresh.manifest.sizes[pos], fresh.manifest.etags[pos]
            try:
                entry, data = await obtain(job, fresh, key, size, etag)
            except StoreError as again:
                raise store_error(again, fresh, where) from None
            return fresh, entry, data, size, etag, "remote"
        except StoreError as exc:
            raise store_error(exc, ds, where) from None


def store_error(exc: StoreError, ds: DatasetState, where: str) -> Exception:
    """The caller's error for a failed store read of ``where`` (a request field); counted."""
    error = _caller_error(exc, ds, where)
    kind = next((name for cls, name in ((ObjectOutsideRoot, "outside_root"), (ObjectMissing, "missing"),
                                         (ObjectChanged, "changed")) if isinstance(exc, cls)), "unavailable")
    metrics.STORE_ERRORS.labels(kind).inc()
    return error


def _caller_error(exc: StoreError, ds: DatasetState, where: str) -> Exception:
    if isinstance(exc, ObjectOutsideRoot):
        return InvalidArgument(str(exc), field=where)
    if isinstance(exc, ObjectMissing):
        return FailedPrecondition(
            f"{exc} although the manifest of {ds.name!r} lists it; re-register the dataset", field=where
        )
    if isinstance(exc, ObjectChanged):
        return FailedPrecondition(
            f"{exc}; the cache serves only the registered version: re-register the dataset "
            f"(silod dataset register {ds.name} {ds.manifest.uri} --replace)",
            field=where,
        )
    return Unavailable(f"remote store: {exc}", field=where)
