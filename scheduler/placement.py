"""Turn per-job GPU counts into concrete GPUs: hard filters, scores, then reserve.

Policies decide *how many* GPUs each job gets (and its batch size); this module decides
*which* ones, the same way for every policy (the Kubernetes scheduler framework's split of
Filter / Score / Reserve):

- filter: nodes of an allowed pool with enough free GPUs;
- score: keep a job where it already runs (a move costs a restart and its local cache),
  then nodes that already cache the job's dataset, then the tightest fit (packing keeps
  large holes free for large jobs and keeps a job on few nodes, where it syncs fastest);
- reserve: take the GPU indices, so no GPU is ever handed out twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan, Pool

Placement = tuple[tuple[str, tuple[int, ...]], ...]


class FreeGpus:
    """Free GPU indices per node; ``reserve`` is the only way to take one."""

    def __init__(self, snapshot: ClusterSnapshot, pools: Iterable[Pool] = ("training",)):
        allowed = set(pools)
        self._free = {n.name: list(range(n.gpus)) for n in snapshot.nodes if n.pool in allowed}
        self._total = sum(len(v) for v in self._free.values())
        # Nodes by their number of free GPUs (> 0), for tightest-fit look-ups.
        self._by_size: dict[int, set[str]] = {}
        for name, free in self._free.items():
            if free:
                self._by_size.setdefault(len(free), set()).add(name)

    def count(self, node: str) -> int:
        return len(self._free.get(node, ()))

    def counts(self) -> dict[str, int]:
        """Free GPUs per node that has any, in node order."""
        return {name: len(free) for name, free in self._free.items() if free}

    @property
    def total(self) -> int:
        return self._total

    def nodes(self) -> list[str]:
        return [name for name, free in self._free.items() if free]

    def has(self, node: str, indices: Iterable[int]) -> bool:
        free = self._free.get(node)
        return free is not None and all(i in free for i in indices)

    def tightest(self, count: int) -> str | None:
        """The node with the fewest free GPUs that still has ``count`` (ties: smallest name), or None."""
        for size in sorted(size for size, names in self._by_size.items() if size >= count and names):
            return min(self._by_size[size])
        return None

    def reserve(self, node: str, indices: Iterable[int]) -> tuple[int, ...]:
        taken = tuple(sorted(indices))
        free = self._free[node]
        before = len(free)
        try:
            for index in taken:
                free.remove(index)  # ValueError here would be a double booking: let it surface
        finally:
            if len(free) != before:
                self._total -= before - len(free)
                self._by_size[before].discard(node)
                if free:
                    self._by_size.setdefault(len(free), set()).add(node)
        return taken

    def reserve_any(self, node: str, count: int) -> tuple[int, ...]:
        return self.reserve(node, self._free[node][:count])


@dataclass(frozen=True)
class PlacementResult:
    placements: Mapping[str, Placement]   # job id -> where it runs (jobs given 0 GPUs are absent)
    unplaced: tuple[str, ...]             # jobs whose requested count did not fit


def cache_by_dataset(snapshot: ClusterSnapshot) -> dict[str, dict[str, float]]:
    """dataset -> {node: bytes cached there} (positive amounts only)."""
    result: dict[str, dict[str, float]] = {}
    for (node, dataset), cached in snapshot.cached_bytes.items():
        if dataset and cached > 0:
            result.setdefault(dataset, {})[node] = cached
    return result


def keep_current(current: Allocation | None, count: int, free: FreeGpus,
                 keep_first: Callable[[str], bool] = lambda node: False) -> Placement | None:
    """The job's current GPUs (or a subset when it shrinks), if all are still free.

    Shrinking keeps survivors on nodes where ``keep_first(node)`` holds first (DeepBoot keeps
    training-pool GPUs and gives lent ones back), then where the job has the most GPUs (fewest nodes).
    """
    if current is None or not current.placement or count > current.gpus:
        return None
    if not all(free.has(node, indices) for node, indices in current.placement):
        return None
    held = [(node, index) for node, indices in current.placement for index in indices]
    if len(set(held)) != len(held):  # a malformed plan naming a GPU twice: place afresh
        return None
    kept: list[tuple[str, tuple[int, ...]]] = []
    remaining = count
    for node, indices in sorted(current.placement, key=lambda p: (not keep_first(p[0]), -len(p[1]), p[0])):
        if remaining == 0:
            break
        take = indices[:remaining]
        kept.append((node, free.reserve(node, take)))
        remaining -= len(take)
    return tuple(sorted(kept))


def fresh_placement(job: JobInfo, count: int, free: FreeGpus, cache: Mapping[str, float]) -> Placement | None:
    """New GPUs for ``job``; ``cache`` maps nodes to bytes of the job's dataset they hold."""
    if free.total < count:
        return None
    # One node if possible: prefer the dataset's cache, then the tightest fit.
    cached = [n for n in cache if free.count(n) >= count]
    best = min(cached, key=lambda n: (-cache[n], free.count(n), n)) if cached else free.tightest(count)
    if best is not None:
        return ((best, free.reserve_any(best, count)),)
    sizes = free.counts()
    # Several nodes, as few as possible: fill the largest holes (cached nodes among equals)
    # until the rest fits on one node, then put the rest on the tightest node that holds it
    # (cached first), which leaves the large holes to large jobs.
    ranked = sorted(sizes, key=lambda n: (-sizes[n], -cache.get(n, 0.0), n))
    chosen: list[tuple[str, tuple[int, ...]]] = []
    remaining = count
    for position, node in enumerate(ranked):
        if sizes[node] >= remaining:
            holding = (n for n in ranked[position:] if sizes[n] >= remaining)
            last = min(holding, key=lambda n: (-cache.get(n, 0.0), sizes[n], n))
            chosen.append((last, free.reserve_any(last, remaining)))
            break
        chosen.append((node, free.reserve_any(node, sizes[node])))
        remaining -= sizes[node]
    return tuple(sorted(chosen))


def place(
    snapshot: ClusterSnapshot,
    gpu_counts: Mapping[str, int],
    order: Sequence[str] | None = None,
    *,
    pools: Iterable[Pool] = ("training",),
) -> PlacementResult:
    """Place every job with a positive count in ``gpu_counts``.

    Jobs that can stay on (a subset of) their current GPUs are placed first, so running jobs
    are not moved to make room; the rest follow ``order`` (default: the order of
    ``gpu_counts``; jobs that ``order`` omits come after it). A job whose count does not
    fit gets nothing and is listed in ``unplaced``: the policy decides what to do with the
    room left (often nothing).
    """
    free = FreeGpus(snapshot, pools)
    jobs = {job.job_id: job for job in snapshot.jobs}
    wanted = {job_id: n for job_id, n in gpu_counts.items() if n > 0}
    placements: dict[str, Placement] = {}
    for job_id, count in wanted.items():
        kept = keep_current(snapshot.current.get(job_id), count, free)
        if kept is not None:
            placements[job_id] = kept
    unplaced = []
    cache = cache_by_dataset(snapshot)
    # ``order`` first, then any job it leaves out (in ``gpu_counts`` order): none is dropped silently.
    sequence = list(order) + list(wanted) if order is not None else list(wanted)
    for job_id in dict.fromkeys(sequence):
        if job_id in placements or job_id not in wanted:
            continue
        job = jobs[job_id]
        fresh = fresh_placement(job, wanted[job_id], free, cache.get(job.dataset, {}) if job.dataset else {})
        if fresh is None:
            unplaced.append(job_id)
        else:
            placements[job_id] = fresh
    return PlacementResult(placements, tuple(unplaced))


def plan_from_placements(placements: Mapping[str, Placement], batch_sizes: Mapping[str, int] | None = None) -> Plan:
    """A plan holding only GPUs (cache and IO unmanaged) — what GPU-only policies return."""
    batch_sizes = batch_sizes or {}
    return Plan({job_id: Allocation(placement=p, batch_size=batch_sizes.get(job_id, 0)) for job_id, p in placements.items()})
