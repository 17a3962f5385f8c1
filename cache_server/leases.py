"""Leases: how local readers get objects without their bytes passing through gRPC.

One Lease per batch pins the batch's cached entries and returns their paths; misses are fetched
(fetch.py) and returned too. A pinned file is never deleted (entries.py). What the cache does
not keep (the policy said no, a peer served it, no space) is written to a transient file that
goes with the lease. A lease ends when its reader releases it (with its next Lease, or
ReleaseLease) or at its expiry, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cache_server.catalog import DatasetCatalog, DatasetState, check_batch, resolve
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.fetch import FetchPipeline
from cache_server.jobs import JobState, JobTable
from cache_server.ranges import ShardRuns
from cache_server.runtime import Runtime
from cache_server.stats import Statistics
from cache_server.tiers import Entry, Tier
from services.runtime.errors import InvalidArgument
from silod.rpc import identifiers

MAX_RELEASES_PER_CALL = 64


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


class LeaseTable:
    def __init__(self, config: CacheConfig, runtime: Runtime, jobs: JobTable, catalog: DatasetCatalog,
                 entries: EntryStore, fetch: FetchPipeline, runs: ShardRuns, statistics: Statistics) -> None:
        self.config = config
        self.runtime = runtime
        self.jobs = jobs
        self.catalog = catalog
        self.entries = entries
        self.fetch = fetch
        self.runs = runs
        self.statistics = statistics
        self.held: dict[str, Lease] = {}  # lease id -> lease, until released or expired
        self._seq = itertools.count()
        transient_base = config.memory_dir or config.disk_dir
        # Where what a lease serves but the cache does not keep is written ("" = nowhere: no path).
        self.transient_dir = os.path.join(transient_base, "transient") if transient_base else ""

    def reset_transient_dir(self) -> None:
        """A fresh directory for transient files (a previous process's are nobody's now)."""
        if self.transient_dir:
            shutil.rmtree(self.transient_dir, ignore_errors=True)
            os.makedirs(self.transient_dir, exist_ok=True)
            os.chmod(self.transient_dir, 0o711)  # readers open their files by path; nobody lists them

    async def lease(self, job_id: str, dataset: str, keys: Sequence[str], lease_s: float) -> tuple[Lease, list[Served]]:
        check_batch(keys)
        if not (lease_s >= 0) or lease_s > self.config.lease_max_s:  # "not >=" also catches NaN
            raise InvalidArgument(f"must be between 0 and {self.config.lease_max_s:g} seconds, got {lease_s}",
                                  field="lease_s")
        ds = await self.catalog.get(dataset)
        positions = resolve(ds, keys)
        manifest = ds.manifest
        job = self.jobs.ensure(job_id)
        job.dataset = job.dataset or dataset
        duration = lease_s or self.config.lease_default_s
        lease = Lease(f"{self.config.node}-{next(self._seq):x}-{secrets.token_hex(4)}", job_id, [], [],
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
                self._end(lease)
                raise failure
            for i, result in zip(missing, results):
                served[i] = result  # type: ignore[assignment]
        self.held[lease.lease_id] = lease
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
            ok = await self.runtime.on_files(entry.tier.verify, entry)
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
        if not self.transient_dir:
            return ""
        path = os.path.join(self.transient_dir, f"{lease.lease_id}-{len(lease.transients)}")
        lease.transients.append(path)

        def write() -> None:
            with open(path, "wb") as f:
                f.write(data)

        try:
            await self.runtime.on_files(write)
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
        lease = self.held.pop(lease_id, None)
        if lease is None:
            return False
        self._end(lease)
        return True

    def release_expired(self, now: float) -> None:
        """Release the leases whose time is up at ``now`` (monotonic)."""
        for lease_id in [lid for lid, lease in self.held.items() if lease.expires <= now]:
            self.release(lease_id)

    def release_every(self) -> None:
        for lease_id in list(self.held):
            self.release(lease_id)

    def _end(self, lease: Lease) -> None:
        for entry in lease.entries:
            self.entries.unpin(entry)
        lease.entries = []
        for path in lease.transients:
            with contextlib.suppress(OSError):
                os.unlink(path)
        lease.transients = []
