"""What the cache server knows of each job that reads through it: its quota and partition from
the plan, its remote-IO bucket, its counters and its prefetch bookkeeping."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cache_server.peers import Peer
from cache_server.policies import PASS_THROUGH, Partition
from cache_server.ratelimit import EventRate, RateMeter, TokenBucket


@dataclass
class JobState:
    job_id: str
    dataset: str = ""
    quota: Any = None  # JobCacheQuota from the plan, or None (best effort)
    partition: Partition | None = None
    bucket: TokenBucket | None = None
    limit: float = 0.0  # bytes/s enforced; 0 = unlimited
    meter: RateMeter = field(default_factory=RateMeter)
    consumption: EventRate = field(default_factory=EventRate)
    hits: int = 0
    misses: int = 0
    remote_bytes: int = 0
    peers: tuple[Peer, ...] = ()  # the job's other nodes (JobCacheQuota.peers): asked before the store
    peer_hits: int = 0  # misses here served from a peer's cache (counted in hits too)
    peer_bytes: int = 0
    # prefetch (DLCache's on-the-fly caching ahead of the job)
    queue: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)
    ahead: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)
    staged: dict[tuple[str, str], bytes] = field(default_factory=dict)
    staged_bytes: int = 0
    staged_from_peer: set[tuple[str, str]] = field(default_factory=set)  # staged bytes a peer served: never admitted
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    worker: asyncio.Task[None] | None = None
    preload: bool = False  # node-wide preload queue: no consumption window
    held: bool = False  # granted no IO by a plan that grants IO to others: remote reads wait
    io_granted: asyncio.Event = field(default_factory=asyncio.Event)  # set while not held

    def __post_init__(self) -> None:
        self.io_granted.set()

    @property
    def pass_through(self) -> bool:
        """The plan gives this job cache policy "none": no reads from or admissions into the tiers."""
        return self.quota is not None and self.quota.cache_policy == PASS_THROUGH

    def set_limit(self, rate: float, burst_s: float, *, hold: bool = False) -> None:
        """Enforce ``rate`` bytes/s (0 = unlimited); ``hold``: no remote reads at all for now
        (the plan grants the job no IO while granting some to others): its fetches wait for
        a plan that grants it a rate or stops limiting it."""
        self.limit = rate
        self.held = hold
        if hold:
            self.io_granted.clear()
        else:
            self.io_granted.set()
        if rate <= 0:
            self.bucket = None
        elif self.bucket is None:
            self.bucket = TokenBucket(rate, burst_s)
        else:
            self.bucket.rate = rate

    def consumed(self, dataset: str, key: str) -> bytes | None:
        """The job read ``key``: forget it from the prefetch bookkeeping; return staged bytes."""
        item = (dataset, key)
        self.staged_from_peer.discard(item)
        self.queue.pop(item, None)
        if self.ahead.pop(item, None) is not None:
            self.wake.set()
        data = self.staged.pop(item, None)
        if data is not None:
            self.staged_bytes -= len(data)
        return data

    def stage(self, item: tuple[str, str], data: bytes) -> None:
        """Hold prefetched bytes the cache did not keep until the job reads them."""
        self.staged[item] = data
        self.staged_bytes += len(data)

    def forget_ahead(self) -> None:
        """Drop what was queued or staged ahead for the job (it is a cache too)."""
        self.queue.clear()
        self.ahead.clear()
        self.staged.clear()
        self.staged_from_peer.clear()
        self.staged_bytes = 0


class JobTable(dict[str, JobState]):
    """Every job that used this server or that the plan names here, by id ("" = preload)."""

    def ensure(self, job_id: str) -> JobState:
        job = self.get(job_id)
        if job is None:
            job = self[job_id] = JobState(job_id)
        return job
