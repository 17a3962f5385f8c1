"""The cache server's engine, free of gRPC: manifests, tiers, partitions (quotas and policies),
remote fetches (single-flight, rate-limited, verified), leases, prefetch and statistics.

All bookkeeping runs on one asyncio event loop (no locks); blocking work (remote reads, file
writes, hashing) runs in two thread pools: one for remote reads (``remote_concurrency``
threads) and one for local files, so a slow store never delays local hits.

Entry points besides the RPCs: :meth:`CacheCore.apply_quotas` (the plan watcher calls it with
a NodePlan's ``cache_quotas`` and version).

Multi-node jobs: a miss of a job whose quota names peers is asked of those nodes' caches first
(cache_server/peers.py) and, if one holds it, served without being admitted here: a job's
content on its nodes stays disjoint, so its hit ratio is that of their union. Only what no peer
holds is read from the store (at the job's IO rate) and admitted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from cache_server import metrics
from cache_server.catalog import (
    DatasetCatalog,
    DatasetState,
    ManifestLoader,
    VersionProbe,
    check_batch,
    import_store_clients,
    resolve,
)
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.jobs import JobState, JobTable
from cache_server.quotas import Quotas
from cache_server.runtime import Runtime
from cache_server.stats import Statistics
from cache_server.peers import PeerReader
from cache_server.policies import PASS_THROUGH, POLICIES, Partition
from cache_server.ratelimit import TokenBucket
from cache_server.tiers import Entry, Tier
from services.runtime.errors import FailedPrecondition, InvalidArgument, Unavailable
from silod.rpc import identifiers
from silod.data.keys import key_problem
from silod.data.shards import SampleRange, parse_sample_key
from silod.data.store import (
    ObjectChanged,
    ObjectMissing,
    ObjectOutsideRoot,
    StoreError,
)

_log = logging.getLogger("silod.cache")

MAX_RELEASES_PER_CALL = 64
MAX_PREFETCH_KEYS = 1 << 20
_TAR_GAP = 1024  # bytes between two samples of a shard: block padding (< 512) and nothing else


class _NoLongerWanted(Exception):
    """A prefetch whose object the job read while the prefetch waited for idle IO."""


@dataclass
class Lease:
    lease_id: str
    job_id: str
    entries: list[Entry]
    transients: list[str]
    expires: float  # monotonic
    expires_wall: float


@dataclass
class Served:
    """One object of a Lease answer."""

    key: str
    path: str  # "" = could not be materialized locally (no space): read it another way
    size: int
    etag: str
    tier: str  # memory, disk, or remote (fetched by this call)


class CacheCore:
    def __init__(
        self, config: CacheConfig, load_manifest: ManifestLoader, probe_version: VersionProbe | None = None,
        peers: PeerReader | None = None,
    ) -> None:
        self.config = config
        self.peers = peers  # None: misses go to the store whatever the plan says
        if config.default_policy not in POLICIES:
            raise ValueError(f"default_policy: must be one of {', '.join(POLICIES)}, got {config.default_policy!r}")
        self.runtime = Runtime(config.remote_concurrency)
        self.entries = EntryStore(config, self.runtime)
        self.catalog = DatasetCatalog(config, self.runtime, load_manifest, probe_version)
        self._inflight: dict[tuple[str, str, str], asyncio.Future[tuple[Entry | None, bytes]]] = {}
        # Object versions whose IO a job is paying for now (waiting in its bucket before it
        # claims the flight): the bucket and a future set once that payment is over.
        self._paying: dict[tuple[str, str, str], tuple[TokenBucket, asyncio.Future[None]]] = {}
        self._jobs = JobTable()
        self.quotas = Quotas(config, self.runtime, self.entries, self._jobs, self.catalog)
        self._leases: dict[str, Lease] = {}
        self._lease_seq = itertools.count()
        self.statistics = Statistics(config.node, self.entries.tiers, self.entries.index)
        transient_base = config.memory_dir or config.disk_dir
        self._transient_dir = os.path.join(transient_base, "transient") if transient_base else ""
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.entries.open()
        if self._transient_dir:
            shutil.rmtree(self._transient_dir, ignore_errors=True)
            os.makedirs(self._transient_dir, exist_ok=True)
        self.runtime.spawn(self._sweep_leases())
        self.runtime.spawn(self.entries.scrub())
        # The lean S3 client's import (botocore's credentials: ~0.2 s of CPU) is not paid on the
        # first job's first miss; s3fs's only when a dataset needs it (_load_dataset).
        self.runtime.spawn(self.runtime.on_remote(import_store_clients, False))
        self._started = True
        self.statistics.update_gauges()

    async def stop(self) -> None:
        self.runtime.cancel_background()
        for job in self._jobs.values():
            if job.worker is not None:
                job.worker.cancel()
        await self.runtime.background_done()
        for lease_id in list(self._leases):
            self.release(lease_id)
        if self.peers is not None:
            await self.peers.close()
        self.runtime.stop_remote_reads()
        await self.catalog.close()
        self.runtime.stop_file_work()
        self.entries.close()

    # -- plan ----------------------------------------------------------------------------------

    def apply_quotas(self, quotas: Sequence[Any], plan_version: int) -> bool:
        """Enforce a NodePlan's ``cache_quotas`` of ``plan_version`` (see :meth:`Quotas.apply`);
        False for a version not newer than the applied one."""
        return self.quotas.apply(quotas, plan_version)

    @property
    def plan_version(self) -> int:
        return self.quotas.plan_version

    # -- jobs and datasets --------------------------------------------------------------------------

    # -- cache index ------------------------------------------------------------------------------

    # -- fetching and admission ---------------------------------------------------------------------

    async def _obtain(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, data: bytes | None = None,
        background: bool = False,
    ) -> tuple[Entry | None, bytes]:
        """Fetch (once, however many callers ask at the same time) and admit one object version.

        ``data``: bytes already at hand (staged by prefetch); then nothing is fetched.
        ``background``: a prefetch; it pays for its bytes only when the job's IO is idle
        (``TokenBucket.acquire_when_idle``), so a reader's misses never queue behind it.
        Every admission goes through here, so one version is never written twice at once.
        """
        flight = (ds.name, key, etag)
        pending = self._inflight.get(flight)
        while pending is None and data is None and job.held:
            # Granted no IO: a fetch of its own waits for a grant, outside the single-flight
            # table (a reader with IO must not wait behind it); a flight someone else starts
            # meanwhile, or a copy admitted meanwhile, serves it at no IO cost.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(job.io_granted.wait(), 0.5)
            pending = self._inflight.get(flight)
            cached = self.entries.lookup(ds.name, key, etag)
            if pending is None and cached is not None and cached.verified and not cached.doomed:
                break
        paid = None  # the bucket this job's IO for the object was paid on, before claiming the flight
        booked = self._paying.get(flight)
        if pending is None and data is None and booked is not None and booked[0] is job.bucket:
            # A reader of the same job is already paying for these bytes, booked earlier in the
            # same bucket (a Lease and a Read of one object, say): wait for that payment and
            # join its flight rather than book the bytes again behind everything booked since.
            await asyncio.shield(booked[1])
            pending = self._inflight.get(flight)
        if pending is None and data is None and job.bucket is not None:
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
                if (ds.name, key) not in job.ahead and flight not in self._inflight:
                    # The job read it (and did not keep it) while this prefetch waited for idle
                    # IO: fetching it now would spend the job's IO on bytes no one reads.
                    paid.refund(size)
                    raise _NoLongerWanted(key)
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
            pending = self._inflight.get(flight)
        if pending is not None:
            if paid is not None:
                paid.refund(size)  # served by someone else's fetch: no IO of its own
            return await asyncio.shield(pending)
        future: asyncio.Future[tuple[Entry | None, bytes]] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._inflight[flight] = future
        try:
            existing = self.entries.index.get((ds.name, key))
            if data is None and existing is not None and existing.etag == etag and existing.verified \
                    and not existing.doomed:
                # Admitted by someone else since the caller looked: a local read beats a remote one.
                data = await self.entries.read_pinned(existing)
            if data is None:
                data = await self._fetch(job, ds, key, size, etag, paid=paid is not None)
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

    async def _fetch(self, job: JobState, ds: DatasetState, key: str, size: int, etag: str,
                     paid: bool = False) -> bytes:
        """``paid``: the caller already waited for this job's IO tokens for these bytes."""
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
                    data = await asyncio.get_running_loop().run_in_executor(
                        self.runtime.remote_pool, ds.store.read, key, size, etag)
            except TimeoutError:
                raise StoreError(f"object {key!r}: no answer from the store within {overall:g}s", key) from None
        ds.cost.observe(len(data), time.monotonic() - started)
        job.remote_bytes += len(data)
        job.meter.add(len(data))
        label = metrics.job_label(job.job_id)
        metrics.labelled(metrics.REMOTE_BYTES, label).inc(len(data))
        metrics.labelled(metrics.REMOTE_FETCHES, label).inc()
        return data

    def _store_error(self, exc: StoreError, ds: DatasetState, where: str) -> Exception:
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

    async def _fetch_uncached(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str
    ) -> tuple[Entry | None, bytes]:
        """Cache policy "none": the object from the store, at the job's IO rate, admitted nowhere.

        No single flight with other readers either: sharing a fetch another job admits would
        hand this job bytes it did not pay remote IO for."""
        data = await self._fetch(job, ds, key, size, etag)
        metrics.labelled(metrics.PASS_THROUGH, metrics.job_label(job.job_id), PASS_THROUGH).inc()
        return None, data

    async def _from_peer(self, job: JobState, ds: DatasetState, key: str, size: int, etag: str) -> bytes | None:
        """The object from the cache of one of the job's other nodes, or None: no peers, a
        pass-through job, or none of them holds this version. Not admitted here by anyone."""
        if self.peers is None or not job.peers or job.pass_through:
            return None
        if (ds.name, key, etag) in self._inflight:
            return None  # being fetched here already (a reader of the dataset without peers): join that
        return await self.peers.read(job.job_id, ds.name, job.peers, key, size, etag)

    async def _get_bytes(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, where: str
    ) -> tuple[DatasetState, Entry | None, bytes, int, str, str]:
        """Obtain a missing object, following a manifest replacement once if the store changed.

        The last item says where it came from: "peer" (a peer's cache; not admitted) or "remote"."""
        obtain = self._fetch_uncached if job.pass_through else self._obtain
        from_peer = (ds.name, key) in job.staged_from_peer
        staged = job.consumed(ds.name, key)
        if staged is not None and len(staged) == size and not job.pass_through:
            if from_peer:
                return ds, None, staged, size, etag, "peer"
            entry, data = await self._obtain(job, ds, key, size, etag, staged)
            return ds, entry, data, size, etag, "remote"
        peer_data = await self._from_peer(job, ds, key, size, etag)
        if peer_data is not None:
            return ds, None, peer_data, size, etag, "peer"
        try:
            entry, data = await obtain(job, ds, key, size, etag)
            return ds, entry, data, size, etag, "remote"
        except ObjectChanged as exc:
            fresh = await self.catalog.reload_for_change(ds)
            pos = fresh.manifest.index.get(key)
            if pos is None or fresh.manifest.etags[pos] == etag:
                raise self._store_error(exc, ds, where) from None
            size, etag = fresh.manifest.sizes[pos], fresh.manifest.etags[pos]
            try:
                entry, data = await obtain(job, fresh, key, size, etag)
            except StoreError as again:
                raise self._store_error(again, fresh, where) from None
            return fresh, entry, data, size, etag, "remote"
        except StoreError as exc:
            raise self._store_error(exc, ds, where) from None

    # -- Lease / ReleaseLease ------------------------------------------------------------------------

    async def lease(self, job_id: str, dataset: str, keys: Sequence[str], lease_s: float) -> tuple[Lease, list[Served]]:
        check_batch(keys)
        if not (lease_s >= 0) or lease_s > self.config.lease_max_s:  # "not >=" also catches NaN
            raise InvalidArgument(f"must be between 0 and {self.config.lease_max_s:g} seconds, got {lease_s}",
                                  field="lease_s")
        ds = await self.catalog.get(dataset)
        positions = resolve(ds, keys)
        manifest = ds.manifest
        job = self._jobs.ensure(job_id)
        job.dataset = job.dataset or dataset
        duration = lease_s or self.config.lease_default_s
        lease = Lease(f"{self.config.node}-{next(self._lease_seq):x}-{secrets.token_hex(4)}", job_id, [], [],
                      time.monotonic() + duration, time.time() + duration)
        served: list[Served | None] = [None] * len(keys)
        missing: list[int] = []
        now = time.monotonic()
        hits: dict[Tier, list[int]] = {}  # counted once per call: this is the hot path
        prefetching = bool(job.ahead or job.queue or job.staged)
        # Cache policy "none": nothing is served from the tiers, every key is a miss.
        index: dict[tuple[str, str], Entry] = {} if job.pass_through else self.entries.index
        stat = os.stat
        for i, pos in enumerate(positions):
            key = manifest.keys[pos]
            etag = manifest.etags[pos]
            entry = index.get((dataset, key))
            if entry is not None:
                if entry.etag != etag:
                    self.entries.evict(entry)
                elif entry.verified and not entry.doomed:
                    try:
                        st = stat(entry.path)
                        intact = st.st_size == entry.size and st.st_mtime_ns == entry.mtime_ns
                    except OSError:
                        intact = False
                    if intact:
                        entry.pins += 1
                        lease.entries.append(entry)
                        self.entries.touch(job, entry, now)
                        tally = hits.get(entry.tier)
                        if tally is None:
                            tally = hits[entry.tier] = [0, 0]
                        tally[0] += 1
                        tally[1] += entry.size
                        if prefetching:
                            job.consumed(dataset, key)
                        served[i] = Served(key, entry.path, entry.size, etag, entry.tier.name)
                        continue
                    self.entries.drop_corrupt(entry)
            missing.append(i)
        for tier, (count, nbytes) in hits.items():
            self.statistics.hits(job, tier, count, nbytes, "lease")
        job.consumption.add(len(keys))
        if missing and not job.pass_through:
            self._read_ahead(job, ds, [positions[i] for i in missing])
        if missing:
            results = await asyncio.gather(
                *(self._lease_miss(job, ds, lease, keys[i], positions[i], f"keys[{i}]") for i in missing),
                return_exceptions=True,
            )
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                self._release(lease)
                raise failure
            for i, result in zip(missing, results):
                served[i] = result  # type: ignore[assignment]
        self._leases[lease.lease_id] = lease
        return lease, served  # type: ignore[return-value]

    async def _lease_miss(self, job: JobState, ds: DatasetState, lease: Lease, key: str, pos: int, where: str) -> Served:
        manifest = ds.manifest
        size, etag = manifest.sizes[pos], manifest.etags[pos]
        entry = None if job.pass_through else self.entries.lookup(ds.name, key, etag)
        if entry is not None and entry.verified and not entry.doomed and self.entries.intact(entry):
            # Admitted (by a prefetch, another reader) since lease() looked.
            entry.pins += 1
            lease.entries.append(entry)
            self.entries.touch(job, entry, time.monotonic())
            self.statistics.hit(job, entry, "lease")
            job.consumed(ds.name, key)
            return Served(key, entry.path, entry.size, etag, entry.tier.name)
        if entry is not None and not entry.verified and not entry.doomed:
            entry.pins += 1  # keep it while it is hashed
            ok = await asyncio.get_running_loop().run_in_executor(self.runtime.file_pool, entry.tier.verify, entry)
            if ok and not entry.doomed:
                entry.verified = True
                lease.entries.append(entry)
                self.entries.touch(job, entry, time.monotonic())
                self.statistics.hit(job, entry, "lease")
                job.consumed(ds.name, key)
                return Served(key, entry.path, entry.size, etag, entry.tier.name)
            self.entries.unpin(entry)
            if not ok:
                self.entries.drop_corrupt(entry)
        ds, entry, data, size, etag, source = await self._get_bytes(job, ds, key, size, etag, where)
        if source == "peer":
            self.statistics.peer_hit(job, size, "lease")
            return Served(key, await self._write_transient(lease, data), size, etag, "peer")
        self.statistics.miss(job, size, "lease")
        if entry is not None and not entry.doomed:
            entry.pins += 1
            lease.entries.append(entry)
            return Served(key, entry.path, size, etag, "remote")
        path = await self._write_transient(lease, data)
        return Served(key, path, size, etag, "remote")

    async def _write_transient(self, lease: Lease, data: bytes) -> str:
        if not self._transient_dir:
            return ""
        path = os.path.join(self._transient_dir, f"{lease.lease_id}-{len(lease.transients)}")
        lease.transients.append(path)

        def write() -> None:
            with open(path, "wb") as f:
                f.write(data)

        try:
            await asyncio.get_running_loop().run_in_executor(self.runtime.file_pool, write)
        except OSError as exc:
            self.runtime.warn_once("transient-" + str(exc.errno), "cannot write a pass-through file; the reader "
                            "gets no path for the object and reads it another way", error=str(exc))
            return ""
        return path

    def release_all(self, lease_ids: Sequence[str]) -> int:
        """Release the leases a Lease call names in ``release_lease_ids`` (before its own keys are
        leased); unknown or expired ids are ignored, as by ReleaseLease. Returns how many were held."""
        if len(lease_ids) > MAX_RELEASES_PER_CALL:
            raise InvalidArgument(f"at most {MAX_RELEASES_PER_CALL} per call, got {len(lease_ids)}",
                                  field="release_lease_ids")
        for i, lease_id in enumerate(lease_ids):
            bad = identifiers.problem(identifiers.LEASE_ID, lease_id)
            if bad is not None:
                raise InvalidArgument(bad, field=f"release_lease_ids[{i}]")
        return sum(self.release(lease_id) for lease_id in lease_ids)

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._release(lease)
        return True

    def _release(self, lease: Lease) -> None:
        for entry in lease.entries:
            self.entries.unpin(entry)
        lease.entries = []
        for path in lease.transients:
            with contextlib.suppress(OSError):
                os.unlink(path)
        lease.transients = []

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.entries.flush_journals()
            self.statistics.update_gauges()  # once a second, not per admitted object
            now = time.monotonic()
            for lease_id in [lid for lid, lease in self._leases.items() if lease.expires <= now]:
                self.release(lease_id)

    # -- Read (bytes through gRPC) ---------------------------------------------------------------------

    async def read(self, job_id: str, dataset: str, keys: Sequence[str]) -> AsyncIterator[tuple[str, str, bytes, str]]:
        """Yield (key, tier, bytes, etag) in order; misses are fetched up to 16 at a time."""
        check_batch(keys)
        ds = await self.catalog.get(dataset)
        positions = resolve(ds, keys)
        job = self._jobs.ensure(job_id)
        job.dataset = job.dataset or dataset
        job.consumption.add(len(keys))
        window = 16
        for start in range(0, len(keys), window):
            batch = range(start, min(len(keys), start + window))
            results = await asyncio.gather(*(self._read_one(job, ds, keys[i], positions[i], f"keys[{i}]") for i in batch))
            for i, (tier, data, etag) in zip(batch, results):
                label = metrics.job_label(job_id)
                metrics.STREAMED_BYTES.labels(job=label).inc(len(data))
                yield keys[i], tier, data, etag

    async def read_cached(self, job_id: str, dataset: str, keys: Sequence[str]) -> AsyncIterator[tuple[str, str, bytes, str]]:
        """``Read(cached_only)``, what a peer cache server asks for its job's misses: yield (key,
        tier, bytes, etag) of the keys this node's tiers hold, in order, skipping the others.

        Never reads the store, admits, prefetches or asks peers (no loops between nodes), and
        needs no manifest: the asker checks the etag against its own. Not counted as a read of
        the job here (its hit ratio here is about its reads on this node)."""
        check_batch(keys)
        bad = identifiers.problem(identifiers.DATASET_NAME, dataset)
        if bad is not None:
            raise InvalidArgument(bad, field="dataset")
        for i, key in enumerate(keys):
            problem = key_problem(key)
            if problem is not None:
                raise InvalidArgument(problem, field=f"keys[{i}]")
        label = metrics.job_label(job_id)

        async def read_entry(entry: Entry) -> bytes | None:
            data = await self.entries.read_pinned(entry)
            if data is None:
                if not entry.doomed:
                    self.entries.drop_corrupt(entry)
                return None
            entry.verified = True
            if entry.partition is not None:  # the job used it: as much a use as a local hit
                entry.partition.on_hit(entry, time.monotonic())
            entry.tier.hits += 1
            metrics.labelled(metrics.HITS, entry.tier.name, label, "peer").inc()
            metrics.labelled(metrics.BYTES, entry.tier.name, label, "peer").inc(entry.size)
            return data

        window = 16
        for start in range(0, len(keys), window):
            entries = [(key, self.entries.index.get((dataset, key))) for key in keys[start:start + window]]
            held = [(key, e) for key, e in entries if e is not None and not e.doomed]
            results = await asyncio.gather(*(read_entry(e) for _, e in held))
            for (key, entry), data in zip(held, results):
                if data is not None:
                    yield key, entry.tier.name, data, entry.etag

    async def _read_one(self, job: JobState, ds: DatasetState, key: str, pos: int,
                        where: str) -> tuple[str, bytes, str]:
        manifest = ds.manifest
        size, etag = manifest.sizes[pos], manifest.etags[pos]
        entry = None if job.pass_through else self.entries.lookup(ds.name, key, etag)
        if entry is not None and not entry.doomed:
            data = await self.entries.read_pinned(entry)
            if data is not None:
                entry.verified = True
                self.entries.touch(job, entry, time.monotonic())
                self.statistics.hit(job, entry, "stream")
                job.consumed(ds.name, key)
                return entry.tier.name, data, etag
            if not entry.doomed:
                self.entries.drop_corrupt(entry)
        _, entry, data, size, etag, source = await self._get_bytes(job, ds, key, size, etag, where)
        if source == "peer":
            self.statistics.peer_hit(job, size, "stream")
        else:
            self.statistics.miss(job, size, "stream")
        return source, data, etag

    # -- Prefetch --------------------------------------------------------------------------------------

    async def prefetch(self, job_id: str, dataset: str, keys: Sequence[str], field: str = "keys") -> tuple[int, int]:
        """Queue objects for background fetching; returns (objects, bytes) newly queued.

        With a job id the queue drains as fast as the job consumes (a window of
        ``prefetch_lookahead_s`` seconds of its measured read rate, between
        ``prefetch_min_objects`` and ``prefetch_max_objects``), charged to its IO rate and
        admitted into its partition; without one (dataset preload) it drains at full speed
        into the shared partition. Empty ``keys`` = the whole manifest. ``field``: the request's
        name for ``keys``, in errors.
        """
        check_batch(keys, MAX_PREFETCH_KEYS, allow_empty=True, field=field)
        ds = await self.catalog.get(dataset)
        manifest = ds.manifest
        positions = resolve(ds, keys, field) if keys else range(len(manifest))
        job = self._jobs.ensure(job_id)
        if job_id:
            job.dataset = job.dataset or dataset
        else:
            job.preload = True
        if job.pass_through:
            return 0, 0  # cache policy "none": fetching ahead would be a cache (of staged bytes)
        objects = nbytes = 0
        for pos in positions:
            key = manifest.keys[pos]
            item = (dataset, key)
            if item in job.queue or item in job.ahead:
                continue
            entry = self.entries.index.get(item)
            if entry is not None and entry.etag == manifest.etags[pos]:
                continue
            job.queue[item] = None
            objects += 1
            nbytes += manifest.sizes[pos]
        if job.queue and job.worker is None:
            job.worker = asyncio.ensure_future(self._prefetch_worker(job))
        return objects, nbytes

    def _window(self, job: JobState) -> int:
        if job.preload:
            return 1 << 30
        wanted = job.consumption.rate() * self.config.prefetch_lookahead_s
        return int(min(self.config.prefetch_max_objects, max(self.config.prefetch_min_objects, wanted)))

    async def _prefetch_worker(self, job: JobState) -> None:
        slots = _PrefetchSlots(asyncio.Semaphore(self.config.prefetch_concurrency if not job.preload
                                                 else max(1, self.config.remote_concurrency // 2)),
                               self.runtime.prefetch_slots)
        tasks: set[asyncio.Task[None]] = set()
        stale_after = max(10.0, 4 * self.config.prefetch_lookahead_s)
        try:
            while job.queue:
                now = time.monotonic()
                while job.ahead and next(iter(job.ahead.values())) < now - stale_after:
                    job.ahead.popitem(last=False)  # prefetched long ago and never read: stop counting it
                if len(job.ahead) >= self._window(job) or job.staged_bytes >= self.config.prefetch_max_staged_bytes:
                    job.wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(job.wake.wait(), 0.2)
                    continue
                (dataset, key), _ = job.queue.popitem(last=False)
                ds = self.catalog.loaded(dataset)
                pos = ds.manifest.index.get(key) if ds is not None else None
                if ds is None or pos is None:
                    continue
                etag, size = ds.manifest.etags[pos], ds.manifest.sizes[pos]
                if self.entries.lookup(dataset, key, etag) is not None or (dataset, key, etag) in self._inflight:
                    continue
                job.ahead[(dataset, key)] = now
                await slots.acquire()
                run = self._coalesce(job, ds, pos)
                if len(run) > 1:
                    # Claimed now, before the next item is coalesced: runs never overlap.
                    flights = self._claim_flights(ds, run)
                    task = asyncio.ensure_future(self._prefetch_run(job, ds, run, flights, slots))
                else:
                    task = asyncio.ensure_future(self._prefetch_one(job, ds, key, size, etag, slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            job.worker = None
            if job.preload and not job.queue:
                job.preload = False

    def _read_ahead(self, job: JobState, ds: DatasetState, positions: list[int]) -> None:
        """Misses of a sharded dataset are fetched with the samples that follow them in their
        shard (see _coalesce), up to ``lease_coalesce_bytes`` per read: a few samples more per
        request than the batch asked for, each a later hit of this epoch. The batch's own
        misses then wait for these flights instead of fetching one range each."""
        if self.config.lease_coalesce_bytes <= 0 or parse_sample_key(ds.manifest.keys[positions[0]]) is None:
            return
        for pos in positions:
            flight = (ds.name, ds.manifest.keys[pos], ds.manifest.etags[pos])
            if flight in self._inflight:
                continue
            run = self._coalesce(job, ds, pos, self.config.lease_coalesce_bytes)
            if len(run) > 1:
                self.runtime.spawn(self._fetch_run(job, ds, run, self._claim_flights(ds, run)))

    def _coalesce(self, job: JobState, ds: DatasetState, pos: int, limit: int = 0) -> list[int]:
        """Manifest positions to fetch with ``pos`` in one ranged read: for a sample of a sharded
        dataset, the samples that follow it in its shard (byte-adjacent, not cached, not being
        fetched), up to ``coalesce_bytes`` and only as far as the job's partition has free
        space for them -- every sample is read once per epoch, so a neighbour fetched now is a
        hit later, as long as nothing has to be evicted for it. Otherwise just ``pos``."""
        manifest = ds.manifest
        first = parse_sample_key(manifest.keys[pos])
        if first is None or job.pass_through or self.config.coalesce_bytes <= 0:
            return [pos]
        if job.peers and self.peers is not None:
            # A neighbour may be cached on another node of the job: read from the store here it
            # would cost remote IO and be cached twice (the job's nodes must hold disjoint content).
            return [pos]
        part = job.partition or self.entries.shared
        budget = min(limit or self.config.coalesce_bytes, part.free() - manifest.sizes[pos])
        run, end, total = [pos], first.offset + first.length, manifest.sizes[pos]
        for nxt in range(pos + 1, len(manifest)):
            sample = parse_sample_key(manifest.keys[nxt])
            if sample is None or sample.shard != first.shard or not 0 <= sample.offset - end < _TAR_GAP:
                break
            if total + manifest.sizes[nxt] > budget or manifest.etags[nxt] != manifest.etags[pos]:
                break
            item = (ds.name, manifest.keys[nxt])
            if item in self.entries.index or (ds.name, manifest.keys[nxt], manifest.etags[nxt]) in self._inflight:
                break
            run.append(nxt)
            end, total = sample.offset + sample.length, total + manifest.sizes[nxt]
        return run

    def _claim_flights(self, ds: DatasetState, run: list[int]) -> list[tuple[Any, asyncio.Future[Any]]]:
        """Every sample of a coalesced run becomes a flight of its own at once, so a reader (or
        another prefetch) asking for one of them meanwhile waits for these bytes instead of
        fetching them again."""
        loop = asyncio.get_running_loop()
        flights: list[tuple[Any, asyncio.Future[Any]]] = []
        for p in run:
            future: asyncio.Future[Any] = loop.create_future()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            flight = (ds.name, ds.manifest.keys[p], ds.manifest.etags[p])
            self._inflight[flight] = future
            flights.append((flight, future))
        return flights

    async def _prefetch_run(self, job: JobState, ds: DatasetState, run: list[int],
                            flights: list[tuple[Any, asyncio.Future[Any]]], slots: _PrefetchSlots) -> None:
        try:
            # Booked like a read, not when idle: the run's flights are claimed already, so a
            # reader of any of its samples waits on this fetch, which must not yield to reads.
            await self._fetch_run(job, ds, run, flights)
        finally:
            slots.release()

    async def _fetch_run(self, job: JobState, ds: DatasetState, run: list[int],
                         flights: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        """One ranged read for byte-adjacent samples of a shard (claimed as ``flights``), each
        admitted on its own; what the job prefetched but its partition did not admit is staged."""
        manifest = ds.manifest
        samples = [parse_sample_key(manifest.keys[p]) for p in run]
        start = samples[0].offset  # type: ignore[union-attr]
        length = samples[-1].offset + samples[-1].length - start  # type: ignore[union-attr]
        span = SampleRange(samples[0].shard, start, length, "").key  # type: ignore[union-attr]
        etag = manifest.etags[run[0]]
        try:
            data = await self._fetch(job, ds, span, length, etag)
            for p, sample, (_, future) in zip(run, samples, flights):
                key, size = manifest.keys[p], manifest.sizes[p]
                offset = sample.offset - start  # type: ignore[union-attr]
                piece = data[offset : offset + size]
                entry = await self.entries.admit(job, ds.name, key, etag, piece, ds.cost)
                future.set_result((entry, piece))
                item = (ds.name, key)
                if entry is None and item in job.ahead and not job.preload:
                    job.staged[item] = piece
                    job.staged_bytes += len(piece)
        except Exception as exc:
            job.ahead.pop((ds.name, manifest.keys[run[0]]), None)
            for _, future in flights:
                if not future.done():
                    future.set_exception(exc)
            _log.debug("coalesced read failed", extra={"dataset": ds.name, "key": span, "error": str(exc)})
        finally:
            for flight, future in flights:
                if not future.done():
                    future.cancel()
                if self._inflight.get(flight) is future:
                    del self._inflight[flight]

    async def _prefetch_one(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, slots: _PrefetchSlots
    ) -> None:
        try:
            item = (ds.name, key)
            data = await self._from_peer(job, ds, key, size, etag)
            if data is not None:
                if item in job.ahead:  # held for the job's read, which serves it without admitting it
                    job.staged[item] = data
                    job.staged_bytes += len(data)
                    job.staged_from_peer.add(item)
                return
            entry, data = await self._obtain(job, ds, key, size, etag, background=True)
            if entry is None and item in job.ahead and not job.preload:
                job.staged[item] = data  # not admitted (quota full): hold it until the job reads it
                job.staged_bytes += len(data)
        except _NoLongerWanted:
            pass
        except Exception as exc:
            job.ahead.pop((ds.name, key), None)
            _log.debug("prefetch failed", extra={"dataset": ds.name, "key": key, "error": str(exc)})
        finally:
            slots.release()

    # -- Stats -------------------------------------------------------------------------------------------

    def stats(self, job_id: str = "") -> dict[str, Any]:
        return self.statistics.report(self._jobs, self.plan_version, job_id)

    # -- introspection for tests and tools ------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        return self.entries.tiers

    @property
    def capacity(self) -> int:
        return self.entries.capacity

    @property
    def shared(self) -> Partition:
        return self.entries.shared

    def entry(self, dataset: str, key: str) -> Entry | None:
        return self.entries.index.get((dataset, key))

    def job(self, job_id: str) -> JobState | None:
        return self._jobs.get(job_id)


class _PrefetchSlots:
    """A prefetch in flight holds one of its job's slots and one of the node's."""

    def __init__(self, job: asyncio.Semaphore, node: asyncio.Semaphore) -> None:
        self.job, self.node = job, node

    async def acquire(self) -> None:
        await self.job.acquire()
        try:
            await self.node.acquire()
        except BaseException:
            self.job.release()
            raise

    def release(self) -> None:
        self.node.release()
        self.job.release()
