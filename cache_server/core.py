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
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cache_server.catalog import DatasetCatalog, ManifestLoader, VersionProbe, import_store_clients
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.fetch import FetchPipeline
from cache_server.jobs import JobState, JobTable
from cache_server.leases import Lease, LeaseTable, Served
from cache_server.peers import PeerReader
from cache_server.policies import POLICIES, Partition
from cache_server.prefetch import Prefetcher
from cache_server.quotas import Quotas
from cache_server.ranges import ShardRuns
from cache_server.runtime import Runtime
from cache_server.stats import Statistics
from cache_server.streaming import Streamed, StreamedReads
from cache_server.tiers import Entry, Tier

__all__ = ["CacheConfig", "CacheCore", "Lease", "Served"]


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
        self.prefetcher = Prefetcher(config, self.runtime, self.jobs, self.catalog, self.entries, self.fetch,
                                     self.runs)

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
        self.prefetcher.stop()
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

    async def prefetch(self, job_id: str, dataset: str, keys: Sequence[str], field: str = "keys") -> tuple[int, int]:
        return await self.prefetcher.prefetch(job_id, dataset, keys, field)

    def stats(self, job_id: str = "") -> dict[str, Any]:
        return self.statistics.report(self.jobs, self.plan_version, job_id)

    def reader_paths(self) -> list[str]:
        """The directories local readers open leased objects in."""
        paths = [tier.root for tier in self.tiers]
        if self.leases.transient_dir:
            paths.append(self.leases.transient_dir)
        return paths

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
