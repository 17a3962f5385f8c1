"""Prefetch (DLCache's on-the-fly caching ahead of the job).

Samplers send the keys a job reads next; a worker per job fetches them in the background,
keeping at most a *window* of fetched-but-unread objects ahead of the job (``prefetch_lookahead_s``
seconds of its measured read rate). Prefetch is charged to the job's IO rate but takes only what
its reads leave idle (fetch.py). What the job's partition does not admit is staged in memory
until the job reads it. Without a job id (a dataset preload) the queue drains at full speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from cache_server.catalog import DatasetCatalog, DatasetState, check_batch, resolve
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.fetch import FetchPipeline, NoLongerWanted
from cache_server.jobs import JobState, JobTable
from cache_server.ranges import Claimed, ShardRuns
from cache_server.runtime import Runtime

_log = logging.getLogger("silod.cache")

MAX_PREFETCH_KEYS = 1 << 20


def prefetch_window(reads_per_s: float, lookahead_s: float, min_objects: int, max_objects: int) -> int:
    """Objects a job may have fetched ahead and not read yet: ``lookahead_s`` seconds of its
    read rate (objects/s), within [min_objects, max_objects]."""
    return int(min(max_objects, max(min_objects, reads_per_s * lookahead_s)))


class PrefetchSlots:
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


class Prefetcher:
    def __init__(self, config: CacheConfig, runtime: Runtime, jobs: JobTable, catalog: DatasetCatalog,
                 entries: EntryStore, fetch: FetchPipeline, runs: ShardRuns) -> None:
        self.config = config
        self.runtime = runtime
        self.jobs = jobs
        self.catalog = catalog
        self.entries = entries
        self.fetch = fetch
        self.runs = runs

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
            job.worker = asyncio.ensure_future(self._worker(job))
        return objects, nbytes

    def stop(self) -> None:
        for job in self.jobs.values():
            if job.worker is not None:
                job.worker.cancel()

    def _window(self, job: JobState) -> int:
        if job.preload:
            return 1 << 30
        return prefetch_window(job.consumption.rate(), self.config.prefetch_lookahead_s,
                               self.config.prefetch_min_objects, self.config.prefetch_max_objects)

    async def _worker(self, job: JobState) -> None:
        slots = PrefetchSlots(asyncio.Semaphore(self.config.prefetch_concurrency if not job.preload
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
                    task = asyncio.ensure_future(self._fetch_run(job, ds, run, flights, slots))
                else:
                    task = asyncio.ensure_future(self._fetch_one(job, ds, key, size, etag, slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            job.worker = None
            if job.preload and not job.queue:
                job.preload = False

    async def _fetch_run(self, job: JobState, ds: DatasetState, run: list[int], flights: Claimed,
                         slots: PrefetchSlots) -> None:
        try:
            # Booked like a read, not when idle: the run's flights are claimed already, so a
            # reader of any of its samples waits on this fetch, which must not yield to reads.
            await self.runs.fetch_run(job, ds, run, flights)
        finally:
            slots.release()

    async def _fetch_one(
        self, job: JobState, ds: DatasetState, key: str, size: int, etag: str, slots: PrefetchSlots
    ) -> None:
        try:
            item = (ds.name, key)
            data = await self.fetch.from_peer(job, ds, key, size, etag)
            if data is not None:
                if item in job.ahead:  # held for the job's read, which serves it without admitting it
                    job.stage(item, data)
                    job.staged_from_peer.add(item)
                return
            entry, data = await self.fetch.obtain(job, ds, key, size, etag, background=True)
            if entry is None and item in job.ahead and not job.preload:
                job.stage(item, data)  # not admitted (quota full): hold it until the job reads it
        except NoLongerWanted:
            pass
        except Exception as exc:
            job.ahead.pop((ds.name, key), None)
            _log.debug("prefetch failed", extra={"dataset": ds.name, "key": key, "error": str(exc)})
        finally:
            slots.release()
