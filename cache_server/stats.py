"""Hits, misses and peer hits of jobs and tiers, the Prometheus series that follow them, and the
``Stats`` report.

A tier's miss is a lookup that fell through to the next tier (or to the store); a peer hit is a
hit of the job (no remote read) but a miss of every tier here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cache_server import metrics
from cache_server.jobs import JobState
from cache_server.tiers import Entry, Tier
from services.runtime.errors import NotFound


class Statistics:
    def __init__(self, node: str, tiers: Sequence[Tier], index: Mapping[tuple[str, str], Entry]) -> None:
        self.node = node
        self.tiers = tiers
        self._index = index  # (dataset, key) -> cached entry: a best-effort job's cached bytes

    def hits(self, job: JobState, tier: Tier, count: int, nbytes: int, path: str) -> None:
        job.hits += count
        for t in self.tiers:
            if t is tier:
                t.hits += count
                break
            t.misses += count
        metrics.labelled(metrics.HITS, tier.name, path).inc(count)
        metrics.labelled(metrics.BYTES, tier.name, path).inc(nbytes)

    def hit(self, job: JobState, entry: Entry, path: str) -> None:
        self.hits(job, entry.tier, 1, entry.size, path)

    def miss(self, job: JobState, size: int, path: str) -> None:
        job.misses += 1
        for tier in self.tiers:
            tier.misses += 1
        metrics.labelled(metrics.MISSES, path).inc()
        metrics.labelled(metrics.BYTES, "remote", path).inc(size)

    def peer_hit(self, job: JobState, size: int, path: str) -> None:
        """A miss here that a peer's cache served: a hit of the job (no remote read), of no tier here."""
        job.hits += 1
        job.peer_hits += 1
        job.peer_bytes += size
        for tier in self.tiers:
            tier.misses += 1
        metrics.labelled(metrics.HITS, "peer", path).inc()
        metrics.labelled(metrics.BYTES, "peer", path).inc(size)

    def served_to_peer(self, entry: Entry) -> None:
        """A peer's cache server read ``entry`` for its job: a hit of the tier, not of a job here
        (the job's hit ratio here is about its reads on this node)."""
        entry.tier.hits += 1
        metrics.labelled(metrics.HITS, entry.tier.name, "peer").inc()
        metrics.labelled(metrics.BYTES, entry.tier.name, "peer").inc(entry.size)

    def remote_read(self, job: JobState, nbytes: int) -> None:
        job.remote_bytes += nbytes
        job.meter.add(nbytes)
        metrics.REMOTE_BYTES.inc(nbytes)
        metrics.REMOTE_FETCHES.inc()

    def update_gauges(self) -> None:
        for tier in self.tiers:
            metrics.USED.labels(tier=tier.name).set(tier.used)

    def job_stats(self, job: JobState) -> dict[str, Any]:
        reads = job.hits + job.misses
        if job.partition is not None:
            cached = job.partition.used
        elif job.pass_through:
            cached = 0
        else:
            cached = sum(e.size for (d, _), e in self._index.items() if d == job.dataset) if job.dataset else 0
        return {
            "job_id": job.job_id,
            "dataset": job.dataset,
            "quota_bytes": job.quota.cache_quota_bytes if job.quota is not None and not job.pass_through else 0,
            "cached_bytes": cached,
            "hits": job.hits,
            "misses": job.misses,
            "hit_ratio": job.hits / reads if reads else 0.0,
            "remote_bytes": job.remote_bytes,
            "remote_io_limit_bytes_per_s": job.limit,
            "remote_io_rate_bytes_per_s": job.meter.rate(),
            "peer_hits": job.peer_hits,
            "peer_bytes": job.peer_bytes,
        }

    def report(self, jobs: Mapping[str, JobState], plan_version: int, job_id: str = "") -> dict[str, Any]:
        """The Stats answer: every tier, and ``job_id``'s numbers (every job's when empty)."""
        self.update_gauges()
        if job_id:
            job = jobs.get(job_id)
            if job is None:
                raise NotFound(f"no job {job_id!r} has used this cache server", field="job_id")
            selected = [job]
        else:
            selected = list(jobs.values())
        return {
            "node": self.node,
            "plan_version": plan_version,
            "tiers": [
                {"tier": t.name, "capacity_bytes": t.capacity, "used_bytes": t.used - t.writing, "hits": t.hits, "misses": t.misses}
                for t in self.tiers
            ],
            "jobs": [self.job_stats(j) for j in selected],
        }
