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
from cache_server.fetch import FetchPipeline, NoLongerWanted
from cache_server.jobs import JobState, JobTable
from cache_server.quotas import Quotas
from cache_server.ranges import ShardRuns
from cache_server.runtime import Runtime
from cache_server.stats import Statistics
from cache_server.peers import PeerReader
from cache_server.policies import POLICIES, Partition
from cache_server.tiers import Entry, Tier
from services.runtime.errors import InvalidArgument
from silod.rpc import identifiers
from silod.data.keys import key_problem

_log = logging.getLogger("silod.cache")

MAX_RELEASES_PER_CALL = 64
MAX_PREFETCH_KEYS = 1 << 20


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
        self._jobs = JobTable()
        self.quotas = Quotas(config, self.runtime, self.entries, self._jobs, self.catalog)
        self.statistics = Statistics(config.node, self.entries.tiers, self.entries.index)
        self.fetch = FetchPipeline(config, self.runtime, self.entries, self.catalog, self.statistics, peers)
        self.runs = ShardRuns(config, self.runtime, self.entries, self.fetch)
        self._leases: dict[str, Lease] = {}
        self._lease_seq = itertools.count()
        transient_base = config.memory_dir or config.disk_dir
        self._transient_dir = os.path.join(transient_base, "transient") if transient_base else ""

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
            self.runs.read_ahead(job, ds, [positions[i] for i in missing])
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
        ds, entry, data, size, etag, source = await self.fetch.get_bytes(job, ds, key, size, etag, where)
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
        _, entry, data, size, etag, source = await self.fetch.get_bytes(job, ds, key, size, etag, where)
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
                if self.entries.lookup(dataset, key, etag) is not None or self.fetch.in_flight((dataset, key, etag)):
                    continue
                job.ahead[(dataset, key)] = now
                await slots.acquire()
                run = self.runs.coalesce(job, ds, pos)
                if len(run) > 1:
                    # Claimed now, before the next item is coalesced: runs never overlap.
                    flights = self.runs.claim(ds, run)
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

    async def _prefetch_run(self, job: JobState, ds: DatasetState, run: list[int],
                            flights: list[tuple[Any, asyncio.Future[Any]]], slots: _PrefetchSlots) -> None:
        try:
            # Booked like a read, not when idle: the run's flights are claimed already, so a
            # reader of any of its samples waits on this fetch, which must not yield to reads.
            await self.runs.fetch_run(job, ds, run, flights)
        finally:
            slots.release()

    async def _prefetch_one(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, slots: _PrefetchSlots
    ) -> None:
        try:
            item = (ds.name, key)
            data = await self.fetch.from_peer(job, ds, key, size, etag)
            if data is not None:
                if item in job.ahead:  # held for the job's read, which serves it without admitting it
                    job.staged[item] = data
                    job.staged_bytes += len(data)
                    job.staged_from_peer.add(item)
                return
            entry, data = await self.fetch.obtain(job, ds, key, size, etag, background=True)
            if entry is None and item in job.ahead and not job.preload:
                job.staged[item] = data  # not admitted (quota full): hold it until the job reads it
                job.staged_bytes += len(data)
        except NoLongerWanted:
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
