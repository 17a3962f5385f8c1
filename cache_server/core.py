"""The cache server's engine, free of gRPC: a composition of the parts below, and the one
interface the gRPC servicer (service.py) and the local lease socket (local_socket.py) call.

| part | module | answers |
|---|---|---|
| the plan's quotas and IO rates, partitions | quotas.py | :meth:`CacheCore.apply_quotas` |
| datasets: manifests, versions, key checks | catalog.py | |
| cached entries: lookup, admission, eviction, scrub | entries.py (tiers.py, policies.py) | |
| a miss: peers, single flight, IO buckets, the store | fetch.py | |
| coalesced ranged reads of tar shards | ranges.py | |
| Lease / ReleaseLease | leases.py | :meth:`lease`, :meth:`release_all`, :meth:`release` |
| Read | streaming.py | :meth:`read`, :meth:`read_cached` |
| Prefetch | prefetch.py | :meth:`prefetch` |
| Stats, counters, gauges | stats.py | :meth:`stats` |

All bookkeeping runs on one asyncio event loop (no locks); blocking work runs in the thread
pools of runtime.py.

Multi-node jobs: a miss of a job whose quota names peers is asked of those nodes' caches first
(cache_server/peers.py) and, if one holds it, served without being admitted here: a job's
content on its nodes stays disjoint, so its hit ratio is that of their union. Only what no peer
holds is read from the store (at the job's IO rate) and admitted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

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
from cache_server.leases import Lease, LeaseTable, Served
from cache_server.peers import PeerReader
from cache_server.policies import POLICIES, Partition
from cache_server.quotas import Quotas
from cache_server.ranges import ShardRuns
from cache_server.runtime import Runtime
from cache_server.stats import Statistics
from cache_server.streaming import Streamed, StreamedReads
from cache_server.tiers import Entry, Tier

__all__ = ["CacheConfig", "CacheCore", "Lease", "Served"]

_log = logging.getLogger("silod.cache")

MAX_PREFETCH_KEYS = 1 << 20


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
        self.jobs = JobTable()
        self.quotas = Quotas(config, self.runtime, self.entries, self.jobs, self.catalog)
        self.statistics = Statistics(config.node, self.entries.tiers, self.entries.index)
        self.fetch = FetchPipeline(config, self.runtime, self.entries, self.catalog, self.statistics, peers)
        self.runs = ShardRuns(config, self.runtime, self.entries, self.fetch)
        self.leases = LeaseTable(config, self.runtime, self.jobs, self.catalog, self.entries, self.fetch,
                                 self.runs, self.statistics)
        self.streams = StreamedReads(self.jobs, self.catalog, self.entries, self.fetch, self.statistics)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.entries.open()
        self.leases.reset_transient_dir()
        self.runtime.spawn(self._housekeeping())
        self.runtime.spawn(self.entries.scrub())
        # The lean S3 client's import (botocore's credentials: ~0.2 s of CPU) is not paid on the
        # first job's first miss; s3fs's only when a dataset needs it (DatasetCatalog._load).
        self.runtime.spawn(self.runtime.on_remote(import_store_clients, False))
        self.statistics.update_gauges()

    async def stop(self) -> None:
        self.runtime.cancel_background()
        for job in self.jobs.values():
            if job.worker is not None:
                job.worker.cancel()
        await self.runtime.background_done()
        self.leases.release_every()
        if self.peers is not None:
            await self.peers.close()
        self.runtime.stop_remote_reads()
        await self.catalog.close()
        self.runtime.stop_file_work()
        self.entries.close()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.entries.flush_journals()
            self.statistics.update_gauges()  # once a second, not per admitted object
            self.leases.release_expired(time.monotonic())

    # -- the interface of the servicer, the local lease socket and the plan watcher ------------

    def apply_quotas(self, quotas: Sequence[Any], plan_version: int) -> bool:
        """Enforce a NodePlan's ``cache_quotas`` of ``plan_version`` (see :meth:`Quotas.apply`);
        False for a version not newer than the applied one."""
        return self.quotas.apply(quotas, plan_version)

    async def lease(self, job_id: str, dataset: str, keys: Sequence[str], lease_s: float) -> tuple[Lease, list[Served]]:
        return await self.leases.lease(job_id, dataset, keys, lease_s)

    def release_all(self, lease_ids: Sequence[str]) -> int:
        return self.leases.release_all(lease_ids)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def read(self, job_id: str, dataset: str, keys: Sequence[str]) -> AsyncIterator[Streamed]:
        return self.streams.read(job_id, dataset, keys)

    def read_cached(self, job_id: str, dataset: str, keys: Sequence[str]) -> AsyncIterator[Streamed]:
        return self.streams.read_cached(job_id, dataset, keys)

    def stats(self, job_id: str = "") -> dict[str, Any]:
        return self.statistics.report(self.jobs, self.plan_version, job_id)

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
        job = self.jobs.ensure(job_id)
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

    # -- introspection for the service, tests and tools ------------------------------------------

    @property
    def plan_version(self) -> int:
        return self.quotas.plan_version

    @property
    def tiers(self) -> list[Tier]:
        return self.entries.tiers

    @property
    def capacity(self) -> int:
        return self.entries.capacity

    @property
    def shared(self) -> Partition:
        return self.entries.shared

    @property
    def _leases(self) -> dict[str, Lease]:  # read by tests/sdk
        return self.leases.held

    def entry(self, dataset: str, key: str) -> Entry | None:
        return self.entries.index.get((dataset, key))

    def job(self, job_id: str) -> JobState | None:
        return self.jobs.get(job_id)


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
