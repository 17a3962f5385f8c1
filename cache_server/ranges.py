"""Coalesced ranged reads of WebDataset tar shards.

A sample of a sharded dataset is a byte range of its shard (silod/data/shards.py). Samples that
follow each other in a shard are fetched together, in one ranged read split into samples that
are admitted one by one: a prefetch reads up to ``coalesce_bytes``, a Lease miss up to
``lease_coalesce_bytes`` (the batch waits for it). Every sample of such a run is claimed as a
flight before the request goes out, so a reader asking for one of them waits for these bytes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cache_server.catalog import DatasetState
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.fetch import FetchPipeline, Flight
from cache_server.jobs import JobState
from cache_server.runtime import Runtime
from silod.data.shards import SampleRange, parse_sample_key

_log = logging.getLogger("silod.cache")

TAR_GAP = 1024  # bytes between two samples of a shard: block padding (< 512) and nothing else

Claimed = list[tuple[Flight, asyncio.Future[Any]]]


class ShardRuns:
    def __init__(self, config: CacheConfig, runtime: Runtime, entries: EntryStore, fetch: FetchPipeline) -> None:
        self.config = config
        self.runtime = runtime
        self.entries = entries
        self.fetch = fetch

    def read_ahead(self, job: JobState, ds: DatasetState, positions: list[int]) -> None:
        """Misses of a sharded dataset are fetched with the samples that follow them in their
        shard (see coalesce), up to ``lease_coalesce_bytes`` per read: a few samples more per
        request than the batch asked for, each a later hit of this epoch. The batch's own
        misses then wait for these flights instead of fetching one range each."""
        if self.config.lease_coalesce_bytes <= 0 or parse_sample_key(ds.manifest.keys[positions[0]]) is None:
            return
        for pos in positions:
            flight = (ds.name, ds.manifest.keys[pos], ds.manifest.etags[pos])
            if self.fetch.in_flight(flight):
                continue
            run = self.coalesce(job, ds, pos, self.config.lease_coalesce_bytes)
            if len(run) > 1:
                self.runtime.spawn(self.fetch_run(job, ds, run, self.claim(ds, run)))

    def coalesce(self, job: JobState, ds: DatasetState, pos: int, limit: int = 0) -> list[int]:
        """Manifest positions to fetch with ``pos`` in one ranged read: for a sample of a sharded
        dataset, the samples that follow it in its shard (byte-adjacent, not cached, not being
        fetched), up to ``coalesce_bytes`` and only as far as the job's partition has free
        space for them -- every sample is read once per epoch, so a neighbour fetched now is a
        hit later, as long as nothing has to be evicted for it. Otherwise just ``pos``."""
        manifest = ds.manifest
        first = parse_sample_key(manifest.keys[pos])
        if first is None or job.pass_through or self.config.coalesce_bytes <= 0:
            return [pos]
        if job.peers and self.fetch.peers is not None:
            # A neighbour may be cached on another node of the job: read from the store here it
            # would cost remote IO and be cached twice (the job's nodes must hold disjoint content).
            return [pos]
        part = job.partition or self.entries.shared
        budget = min(limit or self.config.coalesce_bytes, part.free() - manifest.sizes[pos])
        run, end, total = [pos], first.offset + first.length, manifest.sizes[pos]
        for nxt in range(pos + 1, len(manifest)):
            sample = parse_sample_key(manifest.keys[nxt])
            if sample is None or sample.shard != first.shard or not 0 <= sample.offset - end < TAR_GAP:
                break
            if total + manifest.sizes[nxt] > budget or manifest.etags[nxt] != manifest.etags[pos]:
                break
            item = (ds.name, manifest.keys[nxt])
            if item in self.entries.index or self.fetch.in_flight((ds.name, manifest.keys[nxt], manifest.etags[nxt])):
                break
            run.append(nxt)
            end, total = sample.offset + sample.length, total + manifest.sizes[nxt]
        return run

    def claim(self, ds: DatasetState, run: list[int]) -> Claimed:
        """Every sample of a coalesced run becomes a flight of its own at once, so a reader (or
        another prefetch) asking for one of them meanwhile waits for these bytes instead of
        fetching them again."""
        return self.fetch.claim([(ds.name, ds.manifest.keys[p], ds.manifest.etags[p]) for p in run])

    async def fetch_run(self, job: JobState, ds: DatasetState, run: list[int], flights: Claimed) -> None:
        """One ranged read for byte-adjacent samples of a shard (claimed as ``flights``), each
        admitted on its own; what the job prefetched but its partition did not admit is staged."""
        manifest = ds.manifest
        samples = [parse_sample_key(manifest.keys[p]) for p in run]
        start = samples[0].offset  # type: ignore[union-attr]
        length = samples[-1].offset + samples[-1].length - start  # type: ignore[union-attr]
        span = SampleRange(samples[0].shard, start, length, "").key  # type: ignore[union-attr]
        etag = manifest.etags[run[0]]
        try:
            data = await self.fetch.fetch(job, ds, span, length, etag)
            for p, sample, (_, future) in zip(run, samples, flights):
                key, size = manifest.keys[p], manifest.sizes[p]
                offset = sample.offset - start  # type: ignore[union-attr]
                piece = data[offset : offset + size]
                entry = await self.entries.admit(job, ds.name, key, etag, piece, ds.cost)
                future.set_result((entry, piece))
                item = (ds.name, key)
                if entry is None and item in job.ahead and not job.preload:
                    job.stage(item, piece)
        except Exception as exc:
            job.ahead.pop((ds.name, manifest.keys[run[0]]), None)
            for _, future in flights:
                if not future.done():
                    future.set_exception(exc)
            _log.debug("coalesced read failed", extra={"dataset": ds.name, "key": span, "error": str(exc)})
        finally:
            self.fetch.settle(flights)
