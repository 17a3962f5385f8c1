"""Quota and partition accounting: what a NodePlan's ``cache_quotas`` make of this node's cache
and remote IO.

A *partition* is a bounded set of cached objects managed by one policy (policies.py). Each
(dataset, policy) with a plan quota here has its own, sized by the sum of its readers' quotas
(bytes); everything else shares the rest of the node's capacity (the shared partition, under
``--default-policy``). The validation and the IO rule are pure functions; :class:`Quotas` moves
entries between partitions when a plan changes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cache_server import metrics
from cache_server.catalog import DatasetCatalog
from cache_server.config import CacheConfig
from cache_server.entries import EntryStore
from cache_server.jobs import JobTable
from cache_server.peers import Peer
from cache_server.policies import PASS_THROUGH, PLAN_POLICIES, Partition, make_partition
from cache_server.runtime import Runtime
from cache_server.tiers import Entry
from services.runtime.errors import InvalidArgument
from silod.rpc import identifiers

_log = logging.getLogger("silod.cache")

PartitionKey = tuple[str, str]  # (dataset, policy); dataset "job:<id>" for a job that named none
WarnOnce = Callable[..., None]  # (what, message, **extra): Runtime.warn_once


@dataclass(frozen=True)
class IoGrant:
    rate: float  # bytes/s enforced; 0 = unlimited
    hold: bool = False  # no remote reads at all until a plan grants some


def io_grant(granted_bytes_per_s: int, quota_only_plan: bool, trickle_bytes_per_s: float) -> IoGrant:
    """What a quota's ``remote_io_bytes_per_s`` means here. > 0 is enforced. 0 means "none
    granted": in a plan that grants IO to no job on this node (a quota-only plan) it is not
    limited; in a plan that grants IO to some jobs, a job with 0 gets no remote IO (its misses
    wait for a plan that grants it some, as the SiloD model's b = 0), or the trickle if set."""
    if granted_bytes_per_s > 0:
        return IoGrant(float(granted_bytes_per_s))
    if quota_only_plan:
        return IoGrant(0.0)
    if trickle_bytes_per_s > 0:
        return IoGrant(trickle_bytes_per_s)
    return IoGrant(0.0, hold=True)


def check_quotas(quotas: Sequence[Any], capacity: int, warn_once: WarnOnce) -> int:
    """Raise InvalidArgument, naming the field, for quotas that break the node's invariants;
    return the bytes they reserve (policy "none" reserves nothing)."""
    seen: set[str] = set()
    for i, q in enumerate(quotas):
        where = f"cache_quotas[{i}]"
        if not q.job_id:
            raise InvalidArgument("must not be empty", field=f"{where}.job_id")
        if q.job_id in seen:
            raise InvalidArgument(f"job {q.job_id!r} appears twice", field=f"{where}.job_id")
        seen.add(q.job_id)
        if q.cache_quota_bytes < 0:
            raise InvalidArgument(f"must be >= 0, got {q.cache_quota_bytes}", field=f"{where}.cache_quota_bytes")
        if q.remote_io_bytes_per_s < 0:
            raise InvalidArgument(
                f"must be >= 0, got {q.remote_io_bytes_per_s}", field=f"{where}.remote_io_bytes_per_s"
            )
        for j, peer in enumerate(q.peers):
            bad = identifiers.problem(identifiers.NODE_NAME, peer.node)
            if bad is not None:
                raise InvalidArgument(bad, field=f"{where}.peers[{j}].node")
        if q.cache_policy and q.cache_policy not in PLAN_POLICIES:
            raise InvalidArgument(
                f"must be one of {', '.join(PLAN_POLICIES)} or empty (node default), got {q.cache_policy[:40]!r}",
                field=f"{where}.cache_policy",
            )
        if q.cache_policy == PASS_THROUGH and q.cache_quota_bytes > 0:
            # Not worth refusing the node's whole plan for: the job caches nothing either way,
            # so its bytes are not reserved (the shared part keeps them). Said once per job.
            warn_once(
                f"none-quota-{q.job_id}",
                f"{where}.cache_quota_bytes: ignored for job {q.job_id!r}: cache_policy \"none\" caches nothing",
                job=q.job_id, cache_quota_bytes=q.cache_quota_bytes,
            )
    total = sum(q.cache_quota_bytes for q in quotas if q.cache_policy != PASS_THROUGH)
    if total > capacity:
        raise InvalidArgument(
            f"quotas add up to {total} bytes, more than this node's cache capacity of {capacity} bytes",
            field="cache_quotas",
        )
    return total


def partition_key(q: Any, default_policy: str, job_dataset: str = "") -> PartitionKey | None:
    """The quota partition a JobCacheQuota contributes to: (dataset, policy), or None.
    ``job_dataset``: what the job read here when the quota names no dataset."""
    policy = q.cache_policy or default_policy
    if q.cache_quota_bytes <= 0 or policy == PASS_THROUGH:
        return None
    dataset = q.dataset or job_dataset
    return (dataset or f"job:{q.job_id}", policy)


class Quotas:
    def __init__(self, config: CacheConfig, runtime: Runtime, entries: EntryStore, jobs: JobTable,
                 catalog: DatasetCatalog) -> None:
        self.config = config
        self.runtime = runtime
        self.entries = entries
        self.jobs = jobs
        self.catalog = catalog
        self.plan_version = 0
        self.quota_only_plan = True
        self.parts: dict[PartitionKey, Partition] = {}

    def apply(self, quotas: Sequence[Any], plan_version: int) -> bool:
        """Enforce a NodePlan's ``cache_quotas`` (JobCacheQuota messages) of ``plan_version``.

        Returns False (and changes nothing) for a version not newer than the applied one, so
        a plan is applied at most once. Raises InvalidArgument, naming the field, for a plan
        that breaks the node's invariants (sum of quotas above the cache capacity, ...); the
        previous quotas stay in force then.

        Jobs with a quota get their own partition (policy from the quota, else the node
        default); everything else shares what is left. IO rates: see :func:`io_grant`. Jobs
        absent from the plan are unlimited. Quota partitions are per (dataset, policy):
        the quotas of a dataset's readers add up, and every reader of the dataset here
        admits into and hits the same partition, so its content survives a change of reader.
        Policy ``"none"`` (pass-through, the no-cache baseline): no partition, its quota bytes
        are not reserved, and its reads neither hit nor fill the tiers (hit ratio 0); its IO
        rate applies as for any job.
        """
        if plan_version <= self.plan_version:
            return False
        total = check_quotas(quotas, self.entries.capacity, self.runtime.warn_once)
        now = time.monotonic()
        wanted = self._size_partitions(quotas, now)
        orphans: list[Entry] = []
        for key in [k for k in self.parts if k not in wanted]:
            orphans.extend(self.entries.dissolve(self.parts.pop(key)))
        orphans = self._take_back(orphans, now)
        quota_only = all(q.remote_io_bytes_per_s == 0 for q in quotas)
        self._assign_jobs(quotas, quota_only)
        for part in self.parts.values():
            self.entries.enforce(part)
        shared = self.entries.shared
        shared.capacity = self.entries.capacity - total
        self.entries.enforce(shared)
        for entry in orphans:  # a departed job's objects stay cached while the shared part has room
            if entry.size <= shared.free():
                shared.add(entry, now)
            else:
                self.entries.evict(entry)
        self.quota_only_plan = quota_only
        self.catalog.prepare(q.dataset for q in quotas if q.dataset)
        self.plan_version = plan_version
        metrics.PLAN_VERSION.set(plan_version)
        _log.info(
            "plan applied",
            extra={"plan_version": plan_version, "jobs": len(quotas), "quota_bytes": total,
                   "shared_bytes": shared.capacity},
        )
        return True

    def _size_partitions(self, quotas: Sequence[Any], now: float) -> dict[PartitionKey, int]:
        """Create or resize the quota partitions the plan wants; return them with their bytes."""
        # Quota partitions belong to a (dataset, policy) on this node, not to one job: the
        # plan writes a dataset's quota on one of its readers (co_allocate: the one missing the
        # most) and may move it to another reader of the same dataset from one plan to the
        # next; the cached content must survive that, and every reader of the dataset here
        # fills and hits the same content (as in the simulator's bytes[(node, dataset)]).
        wanted: dict[PartitionKey, int] = {}
        for q in quotas:
            job = self.jobs.get(q.job_id)
            key = partition_key(q, self.config.default_policy, job.dataset if job is not None else "")
            if key is not None:
                wanted[key] = wanted.get(key, 0) + q.cache_quota_bytes
        for key, capacity in wanted.items():
            part = self.parts.get(key)
            if part is None:
                part = self.parts[key] = make_partition(
                    key[1], f"{key[0]}/{key[1]}", capacity, half_life_s=self.config.lrfu_half_life_s
                )
                # A policy change of the dataset: its objects move to the new partition.
                for other in [k for k in self.parts if k[0] == key[0] and k not in wanted]:
                    for entry in self.entries.dissolve(self.parts.pop(other)):
                        part.add(entry, now)
            part.capacity = capacity
        return wanted

    def _take_back(self, orphans: list[Entry], now: float) -> list[Entry]:
        """Home ``orphans`` and the shared part's objects in their dataset's partition while it has
        room; return the orphans left homeless."""
        # A dataset's partition takes its cached objects that nobody's quota holds now (a
        # departed partition's, or the shared part's: a dataset read again after a plan
        # without it) while it has room, before the shared part shrinks below them.
        by_dataset: dict[str, list[Partition]] = {}
        for key, part in self.parts.items():
            by_dataset.setdefault(key[0], []).append(part)
        kept: list[Entry] = []
        shared = self.entries.shared
        for entry in orphans + [e for e in list(shared.entries.values()) if e.dataset in by_dataset]:
            home = next((p for p in by_dataset.get(entry.dataset, []) if entry.size <= p.free()), None)
            if home is None:
                if entry.partition is None:
                    kept.append(entry)
                continue
            if entry.partition is not None:
                entry.partition.remove(entry)
            home.add(entry, now)
        return kept

    def _assign_jobs(self, quotas: Sequence[Any], quota_only: bool) -> None:
        """Give each job its quota, partition, peers and IO limit; jobs the plan left lose theirs."""
        burst_s = self.config.io_burst_s
        new_ids = {q.job_id for q in quotas}
        for job in self.jobs.values():
            if job.quota is not None and job.job_id not in new_ids:
                job.partition = None
                job.quota = None
                job.peers = ()
                job.set_limit(0, burst_s)
        for q in quotas:
            job = self.jobs.ensure(q.job_id)
            job.quota = q
            job.peers = tuple(Peer(p.node, p.cache_address) for p in q.peers if p.node != self.config.node)
            if q.dataset:
                job.dataset = q.dataset
            policy = q.cache_policy or self.config.default_policy
            key = (job.dataset or f"job:{q.job_id}", policy)
            # A reader with quota 0 of a dataset that has a quota here shares its partition.
            job.partition = self.parts.get(key) if policy != PASS_THROUGH else None
            if policy == PASS_THROUGH:  # what was queued or staged ahead for the job is a cache too
                job.forget_ahead()
            grant = io_grant(q.remote_io_bytes_per_s, quota_only, self.config.unallocated_io_trickle_bytes_per_s)
            job.set_limit(grant.rate, burst_s, hold=grant.hold)
