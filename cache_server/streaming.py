"""Read: object bytes through gRPC, for readers on other hosts (or in another mount namespace)
and, with ``cached_only``, for the cache servers of a multi-node job's other nodes.

A cached file is read and checked against its sha256 before it is sent; misses go through the
fetch pipeline as a Lease's do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from cache_server import metrics
from cache_server.catalog import DatasetCatalog, DatasetState, check_batch, resolve
from cache_server.entries import EntryStore
from cache_server.fetch import FetchPipeline
from cache_server.jobs import JobState, JobTable
from cache_server.stats import Statistics
from cache_server.tiers import Entry
from services.runtime.errors import InvalidArgument
from silod.data.keys import key_problem
from silod.rpc import identifiers

WINDOW = 16  # objects read (or fetched) at once per call

Streamed = tuple[str, str, bytes, str]  # key, tier ("memory", "disk", "remote" or "peer"), bytes, etag


class StreamedReads:
    def __init__(self, jobs: JobTable, catalog: DatasetCatalog, entries: EntryStore, fetch: FetchPipeline,
                 statistics: Statistics) -> None:
        self.jobs = jobs
        self.catalog = catalog
        self.entries = entries
        self.fetch = fetch
        self.statistics = statistics

    async def read(self, job_id: str, dataset: str, keys: Sequence[str]) -> AsyncIterator[Streamed]:
        """Yield (key, tier, bytes, etag) in order; misses are fetched up to 16 at a time."""
        check_batch(keys)
        ds = await self.catalog.get(dataset)
        positions = resolve(ds, keys)
        job = self.jobs.ensure(job_id)
        job.dataset = job.dataset or dataset
        job.consumption.add(len(keys))
        for start in range(0, len(keys), WINDOW):
            batch = range(start, min(len(keys), start + WINDOW))
            results = await asyncio.gather(*(self._read_one(job, ds, keys[i], positions[i], f"keys[{i}]") for i in batch))
            for i, (tier, data, etag) in zip(batch, results):
                metrics.STREAMED_BYTES.inc(len(data))
                yield keys[i], tier, data, etag

    async def read_cached(self, job_id: str, dataset: str, keys: Sequence[str]) -> AsyncIterator[Streamed]:
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

        async def read_entry(entry: Entry) -> bytes | None:
            data = await self.entries.read_pinned(entry)
            if data is None:
                if not entry.doomed:
                    self.entries.drop_corrupt(entry)
                return None
            entry.verified = True
            if entry.partition is not None:  # the job used it: as much a use as a local hit
                entry.partition.on_hit(entry, time.monotonic())
            self.statistics.served_to_peer(entry)
            return data

        for start in range(0, len(keys), WINDOW):
            entries = [(key, self.entries.index.get((dataset, key))) for key in keys[start:start + WINDOW]]
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
