"""The entry store: which object versions the tiers hold and which partition manages each;
admission, eviction and verification of cached files.

Tiers (tiers.py) are placement: a new object goes to the memory tier while it has room, then to
disk. Partitions (policies.py) decide what stays. A pinned entry (leased, or being read) is
never deleted: evicted while pinned, it is *doomed* and its file goes with the last pin.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import secrets
import time

from cache_server import metrics
from cache_server.config import CacheConfig
from cache_server.jobs import JobState
from cache_server.policies import FetchCostModel, Partition, make_partition
from cache_server.runtime import Runtime
from cache_server.tiers import Entry, Tier, entry_name, is_no_space

_log = logging.getLogger("silod.cache")


class EntryStore:
    def __init__(self, config: CacheConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        self.tiers: list[Tier] = []
        if config.memory_dir and config.memory_bytes > 0:
            # tmpfs: no fsync needed (and none possible that matters)
            self.tiers.append(Tier("memory", config.memory_dir, config.memory_bytes, fsync=False))
        if config.disk_dir and config.disk_bytes > 0:
            self.tiers.append(Tier("disk", config.disk_dir, config.disk_bytes, fsync=config.fsync))
        self.capacity = sum(t.capacity for t in self.tiers)  # bytes, all tiers
        # What no quota of the plan holds: every best-effort job's objects, under --default-policy.
        self.shared: Partition = make_partition(
            config.default_policy, "shared", self.capacity, half_life_s=config.lrfu_half_life_s
        )
        self.index: dict[tuple[str, str], Entry] = {}  # (dataset, key) -> the one cached version
        # Admission file suffixes: random per process (a restart never reuses a name), then a
        # counter (os.urandom per admission released the GIL to 64 fetch threads every time).
        self._admission_prefix = secrets.token_hex(3)
        self._admissions = itertools.count()

    async def open(self) -> None:
        """Re-index the tiers from their journals; everything found starts in the shared partition."""
        for tier in self.tiers:
            entries = await self.runtime.on_files(tier.open)
            for entry in entries:
                old = self.index.get((entry.dataset, entry.key))
                if old is not None:  # the same object in two tiers after a crash: keep one
                    self.delete_file(entry)
                    continue
                self.index[(entry.dataset, entry.key)] = entry
                self.shared.add(entry, 0.0)
            metrics.CAPACITY.labels(tier=tier.name).set(tier.capacity)
            _log.info(
                "cache tier ready",
                extra={"tier": tier.name, "dir": tier.root, "capacity_bytes": tier.capacity,
                       "reindexed_objects": len(entries), "reindexed_bytes": sum(e.size for e in entries)},
            )
        self.enforce(self.shared)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def flush_journals(self) -> None:
        for tier in self.tiers:
            tier.flush_journal()

    # -- lookup and use ----------------------------------------------------------------------------

    def lookup(self, dataset: str, key: str, etag: str) -> Entry | None:
        entry = self.index.get((dataset, key))
        if entry is None:
            return None
        if entry.etag != etag:  # the manifest moved on: that copy is another version
            self.evict(entry)
            return None
        return entry

    def touch(self, job: JobState, entry: Entry, now: float) -> None:
        part = entry.partition
        if part is not None:
            part.on_hit(entry, now)
            # A job with its own quota adopts objects it reads from the shared part while it has room.
            mine = job.partition
            if mine is not None and part is self.shared and entry.size <= mine.free():
                part.remove(entry)
                mine.add(entry, now)

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.doomed:
            self.delete_file(entry)

    async def read_pinned(self, entry: Entry) -> bytes | None:
        """The entry's bytes if they still hash to what was cached, else None; pinned meanwhile."""
        entry.pins += 1
        try:
            return await self.runtime.on_files(read_verified, entry)
        finally:
            self.unpin(entry)

    @staticmethod
    def intact(entry: Entry) -> bool:
        """Cheap check that nobody wrote to the file since it was cached (size and mtime)."""
        try:
            st = os.stat(entry.path)
        except OSError:
            return False
        return st.st_size == entry.size and st.st_mtime_ns == entry.mtime_ns

    def drop_corrupt(self, entry: Entry) -> None:
        metrics.CORRUPT.labels(tier=entry.tier.name).inc()
        _log.warning("cached file failed verification; dropped and fetched again",
                     extra={"tier": entry.tier.name, "dataset": entry.dataset, "key": entry.key, "path": entry.path})
        self.evict(entry)

    async def scrub(self) -> None:
        """Verify, in the background, the entries re-indexed at start (first use verifies too)."""
        for entry in [e for e in self.index.values() if not e.verified]:
            if entry.verified or entry.doomed or self.index.get((entry.dataset, entry.key)) is not entry:
                continue
            entry.pins += 1
            try:
                ok = await self.runtime.on_files(entry.tier.verify, entry)
            finally:
                self.unpin(entry)
            if ok:
                entry.verified = True
            elif not entry.doomed:
                self.drop_corrupt(entry)
            await asyncio.sleep(0)

    # -- eviction ----------------------------------------------------------------------------------

    def evict(self, entry: Entry) -> None:
        """Take ``entry`` out of the cache; its file goes now, or when its last pin goes."""
        if entry.partition is not None:
            entry.partition.remove(entry)
        if self.index.get((entry.dataset, entry.key)) is entry:
            del self.index[(entry.dataset, entry.key)]
            metrics.EVICTIONS.labels(tier=entry.tier.name).inc()
        entry.doomed = True
        if entry.pins == 0:
            self.delete_file(entry)

    def delete_file(self, entry: Entry) -> None:
        if entry.deleted:
            return
        entry.deleted = True
        entry.doomed = True
        entry.tier.unlink(entry)
        entry.tier.used -= entry.size
        entry.tier.journal_del(entry)

    def enforce(self, part: Partition) -> None:
        """Evict what ``part`` holds beyond its capacity (after a quota cut, say)."""
        if part.used + part.reserved > part.capacity:
            for victim in part.shrink_victims():
                self.evict(victim)

    @staticmethod
    def dissolve(part: Partition) -> list[Entry]:
        """Empty ``part``; its entries stay cached, homeless, for the caller to place."""
        entries = list(part.entries.values())
        for entry in entries:
            part.remove(entry)
        return entries

    # -- admission ---------------------------------------------------------------------------------

    def _place(self, size: int, now: float) -> Tier | None:
        for tier in self.tiers:
            if tier.free() >= size and tier.full_until <= now:
                return tier
        return None

    async def admit(self, job: JobState, dataset: str, key: str, etag: str, data: bytes,
                    cost_model: FetchCostModel) -> Entry | None:
        """Cache ``data`` in ``job``'s partition (else the shared one) if its policy agrees and a
        tier has room; None when it is served without being cached (pass-through)."""
        existing = self.index.get((dataset, key))
        if existing is not None and existing.etag == etag and not existing.doomed:
            return existing
        size = len(data)
        now = time.monotonic()
        part = job.partition or self.shared
        cost = cost_model.cost(size)
        victims = part.plan_admission(size, cost, now)
        if victims is None:
            metrics.PASS_THROUGH.labels(reason="policy").inc()
            return None
        for victim in victims:
            self.evict(victim)
        tier = self._place(size, now)
        if tier is None:
            metrics.PASS_THROUGH.labels(reason="no-space").inc()
            return None
        part.reserved += size
        tier.used += size
        tier.writing += size
        # Unique per admission: a doomed (evicted, still leased) copy of the same version never
        # shares a path with its successor.
        name = f"{entry_name(dataset, key, etag)}.{self._admission_prefix}{next(self._admissions):x}"
        try:
            digest, mtime_ns = await self.runtime.on_files(tier.write, name, data)
        except OSError as exc:
            tier.writing -= size
            part.reserved -= size
            tier.used -= size
            if is_no_space(exc):
                tier.full_until = time.monotonic() + self.config.no_space_backoff_s
                self.runtime.warn_once(f"enospc-{tier.name}-{int(tier.full_until)}",
                                       "cache tier out of space; serving without caching for a while",
                                       tier=tier.name, dir=tier.root, retry_after_s=self.config.no_space_backoff_s)
                metrics.PASS_THROUGH.labels(reason="no-space").inc()
            else:
                _log.warning("cannot write a cache file; serving without caching",
                             extra={"tier": tier.name, "error": str(exc)})
                metrics.PASS_THROUGH.labels(reason="write-error").inc()
            return None
        part.reserved -= size
        tier.writing -= size
        old = self.index.get((dataset, key))
        if old is not None:
            self.evict(old)
        entry = Entry(dataset, key, etag, size, tier, name, digest, mtime_ns, cost_s=cost)
        self.index[(dataset, key)] = entry
        current = job.partition or self.shared  # a plan may have arrived while writing
        current.add(entry, time.monotonic())
        tier.journal_put(entry)
        self.enforce(current)
        if tier.journal_needs_compaction(len(self.index)):
            snapshot = [e for e in self.index.values() if e.tier is tier]
            self.runtime.spawn(self.runtime.on_files(tier.compact, snapshot))
        return entry


def read_verified(entry: Entry) -> bytes | None:
    """The file's bytes if they still hash to what was cached, else None (blocking)."""
    try:
        with open(entry.path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        return None
    return data
