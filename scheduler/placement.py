"""Turn per-job GPU counts into concrete GPUs: hard filters, scores, then reserve.

Policies decide *how many* GPUs each job gets (and its batch size); this module decides
*which* ones, the same way for every policy (the Kubernetes scheduler framework's split of
Filter / Score / Reserve):

- filter: nodes of an allowed pool with enough free GPUs, of one GPU type (below), and for a
  job that requests cores or memory per rank, room for its ranks (:mod:`scheduler.rank_requests`;
  a job without requests is placed by GPUs alone);
- score: keep a job where it already runs (a move costs a restart and its local cache),
  then nodes that already cache the job's dataset, then the tightest fit (packing keeps
  large holes free for large jobs and keeps a job on few nodes, where it syncs fastest);
- reserve: take the GPU indices (and the ranks' cores and memory), so no GPU is ever handed
  out twice and no node's cores or memory are promised beyond what it has.

**GPU types: one type per job.** Every placement :func:`place` makes is on nodes of a single
GPU type: a data-parallel job steps in lockstep, so ranks on a faster type would wait for
the slowest one, and its throughput model (:mod:`estimator.gpu_types`) is per type. The type
is the first of the job's ``preferences`` (the policy names them, e.g. Gavel's LP) whose
nodes have room for the whole count; without preferences, :func:`type_preferences` ranks
the types the job allows (``JobInfo.gpu_types``) by the job's predicted goodput on them at
that count — the fastest type with room. Untyped nodes (``gpu_type`` "") form one type of
their own, so a homogeneous cluster places exactly as before. DeepBoot's lending
(:mod:`scheduler.deepboot.lending`) keeps a typed job on lent GPUs of its own type. A plan
that mixes types anyway is charged its job's slowest type (:func:`slowest_type`). The type
choice itself lives in :mod:`scheduler.gpu_type_choice`; its names are importable from here too.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler import rank_requests
from scheduler.gpu_type_choice import (  # noqa: F401 (the type choice's names, re-exported for the policies)
    TypeRoom,
    blind_preferences,
    largest_type_gpus,
    node_types,
    placement_type,
    slowest_type,
    type_preferences,
)
from scheduler.policy import UNLIMITED, Allocation, ClusterSnapshot, JobInfo, Plan, Pool
from scheduler.rank_requests import NodeRoom

Placement = tuple[tuple[str, tuple[int, ...]], ...]


class FreeGpus:
    """Free GPU indices per node; ``reserve`` is the only way to take one.

    A node's free GPUs are the set bits of an integer (bit i: GPU i is free), so checking and
    taking a job's GPUs are a few integer operations rather than list scans.
    """

    def __init__(self, snapshot: ClusterSnapshot, pools: Iterable[Pool] = ("training",)):
        pools = tuple(pools)
        self._nodes, self._room = snapshot.nodes, None  # cores and memory: rank_requests, for jobs with requests only
        # Every round starts from the same empty nodes: copy a view built once per node tuple.
        key = (id(snapshot.nodes), pools)
        found = _EMPTY.get(key)
        if found is not None and found[0] is snapshot.nodes:
            self._copy_from(found[1])
            return
        self._build(snapshot.nodes, pools)
        with _EMPTY_LOCK:
            if len(_EMPTY) >= _EMPTY_KEPT:
                _EMPTY.pop(next(iter(_EMPTY)))
            empty = object.__new__(FreeGpus)
            empty._copy_from(self)
            _EMPTY[key] = (snapshot.nodes, empty)  # the entry holds the tuple: its id stays its own

    def _copy_from(self, other: "FreeGpus") -> None:
        self._gpus = getattr(other, "_gpus", None)  # node -> its GPUs, built by release when first needed
        self._mask, self._size, self._type = dict(other._mask), dict(other._size), other._type  # types never change
        self._total, self._total_by_type = other._total, dict(other._total_by_type)
        self._by_size = {key: set(names) for key, names in other._by_size.items()}
        self._smallest = {key: list(heap) for key, heap in other._smallest.items()}
        self._types, self._widest = other._types, other._widest

    def _build(self, nodes, pools: tuple[Pool, ...]) -> None:
        allowed = set(pools)
        self._gpus = None
        self._mask = {n.name: (1 << n.gpus) - 1 for n in nodes if n.pool in allowed}
        self._size = {n.name: n.gpus for n in nodes if n.pool in allowed}
        self._type = {n.name: n.gpu_type for n in nodes if n.pool in allowed}
        self._total = sum(self._size.values())
        self._total_by_type: dict[str, int] = {}
        # Nodes by (GPU type, number of free GPUs > 0), for tightest-fit look-ups: a set, and a
        # heap of the same names for the smallest (entries of nodes that left the set are skipped).
        self._by_size: dict[tuple[str, int], set[str]] = {}
        self._smallest: dict[tuple[str, int], list[str]] = {}
        for name, size in self._size.items():
            self._total_by_type[self._type[name]] = self._total_by_type.get(self._type[name], 0) + size
            if size:
                self._by_size.setdefault((self._type[name], size), set()).add(name)
        for key, names in self._by_size.items():
            self._smallest[key] = sorted(names)  # a sorted list is a heap
        self._types = tuple(sorted(self._total_by_type))
        self._widest = max(self._size.values(), default=0)

    @property
    def room(self) -> NodeRoom:
        """Cores and memory not yet requested per node (built when a job with requests asks)."""
        if self._room is None:
            self._room = NodeRoom(self._nodes)
        return self._room

    def share_room(self, other: "FreeGpus") -> None:
        """Count cores and memory in ``other``'s room: two views of the same nodes take them once."""
        self._room = other.room

    def count(self, node: str) -> int:
        return self._size.get(node, 0)

    def counts(self, gpu_type: str | None = None) -> dict[str, int]:
        """Free GPUs per node that has any (of ``gpu_type`` if given), in no particular order."""
        return {name: size for (t, size), names in self._by_size.items() if gpu_type is None or t == gpu_type
                for name in names}

    @property
    def total(self) -> int:
        return self._total

    def total_of(self, gpu_type: str) -> int:
        """Free GPUs on nodes of ``gpu_type``."""
        return self._total_by_type.get(gpu_type, 0)

    def types(self) -> list[str]:
        """GPU types with a free GPU, sorted."""
        return sorted(t for t, n in self._total_by_type.items() if n > 0)

    def type_of(self, node: str) -> str:
        return self._type.get(node, "")

    def nodes(self) -> list[str]:
        return [name for name, size in self._size.items() if size]

    def has(self, node: str, indices: Iterable[int]) -> bool:
        mask = self._mask.get(node)
        if mask is None:
            return False
        bits = _bits(indices)
        return bits is not None and mask & bits == bits

    def tightest(self, count: int, gpu_type: str | None = None) -> str | None:
        """The node (of ``gpu_type`` if given) with the fewest free GPUs that still has ``count``
        (ties: smallest name), or None."""
        # Sizes upwards: the first size any node of the types has is the tightest fit.
        for size in range(max(count, 1), self._widest + 1):
            best = self._first_of_size(size, gpu_type)
            if best is not None:
                return best
        return None

    def widest(self, gpu_type: str | None = None) -> str | None:
        """The node (of ``gpu_type`` if given) with the most free GPUs (ties: smallest name), or None."""
        for size in range(self._widest, 0, -1):
            best = self._first_of_size(size, gpu_type)
            if best is not None:
                return best
        return None

    def _first_of_size(self, size: int, gpu_type: str | None) -> str | None:
        """The smallest name of the nodes (of ``gpu_type`` if given) with exactly ``size`` free GPUs."""
        by_size = self._by_size
        best: str | None = None
        for kind in self._types if gpu_type is None else (gpu_type,):
            names = by_size.get((kind, size))
            if names:
                heap = self._smallest[(kind, size)]
                while heap[0] not in names:
                    heapq.heappop(heap)
                if best is None or heap[0] < best:
                    best = heap[0]
        return best

    def reserve(self, node: str, indices: Iterable[int]) -> tuple[int, ...]:
        """Take GPUs ``indices`` of ``node``; ValueError if one is not free (a double booking:
        let it surface), KeyError for a node this view does not have."""
        mask = self._mask[node]
        taken = tuple(sorted(indices))
        bits = _bits(taken)
        if bits is None or mask & bits != bits:
            raise ValueError(f"GPUs {taken} of {node} are not all free")
        self._take(node, mask, bits, len(taken))
        return taken

    def take(self, node: str, indices: tuple[int, ...]) -> tuple[int, ...] | None:
        """:meth:`reserve` if all of ``indices`` are free GPUs of ``node`` (the sorted indices), else None."""
        mask = self._mask.get(node)
        bits = _bits(indices)
        if mask is None or bits is None or mask & bits != bits:
            return None
        self._take(node, mask, bits, len(indices))
        return indices if _ascending(indices) else tuple(sorted(indices))

    def reserve_any(self, node: str, count: int) -> tuple[int, ...]:
        """The node's first ``count`` free GPUs (lowest indices)."""
        mask = self._mask[node]
        key = (mask, count)
        found = _LOWEST.get(key)
        if found is None:
            taken, rest = [], mask
            while rest and len(taken) < count:
                low = rest & -rest
                taken.append(low.bit_length() - 1)
                rest ^= low
            found = (tuple(taken), mask ^ rest)
            if len(_LOWEST) < _MEMO_KEPT:
                _LOWEST[key] = found
        self._take(node, mask, found[1], len(found[0]))
        return found[0]

    def release(self, node: str, indices: tuple[int, ...]) -> bool:
        """Give GPUs ``indices`` of ``node`` back (a view carried from round to round, whose job
        left); False, and nothing changed, if one of them is not taken or the node is not here."""
        mask = self._mask.get(node)
        bits = _bits(indices)
        if mask is None or bits is None or mask & bits or bits >> self._capacity(node):
            return False
        before = self._size[node]
        after = self._size[node] = before + len(indices)
        self._mask[node] = mask | bits
        gpu_type = self._type[node]
        self._total += len(indices)
        self._total_by_type[gpu_type] += len(indices)
        if before:
            self._by_size[(gpu_type, before)].discard(node)
        key = (gpu_type, after)
        self._by_size.setdefault(key, set()).add(node)
        heapq.heappush(self._smallest.setdefault(key, []), node)
        self._widest = max(self._widest, after)
        return True

    def _capacity(self, node: str) -> int:
        """The node's GPUs (its free set's width when all are free)."""
        if self._gpus is None:
            self._gpus = {n.name: n.gpus for n in self._nodes}
        return self._gpus.get(node, 0)

    def copy(self) -> "FreeGpus":
        """An independent view of the same free GPUs."""
        # A view carried from round to round (takes and releases) piles up names that left a
        # size in its heaps, which every copy would skip again: drop them first, now and then.
        by_size = self._by_size
        for key, heap in self._smallest.items():
            if len(heap) > 2 * len(by_size.get(key, ())) + 8:
                self._smallest[key] = sorted(by_size.get(key, ()))  # a sorted list is a heap
        other = object.__new__(FreeGpus)
        other._copy_from(self)
        other._nodes, other._room = self._nodes, None
        return other

    def _take(self, node: str, mask: int, bits: int, count: int) -> None:
        """Book-keeping for taking the GPUs ``bits`` (``count`` of them) of ``node``, whose free set was ``mask``."""
        if not count:
            return
        self._mask[node] = mask & ~bits
        before = self._size[node]
        after = self._size[node] = before - count
        gpu_type = self._type[node]
        self._total -= count
        self._total_by_type[gpu_type] -= count
        self._by_size[(gpu_type, before)].discard(node)
        if after:
            key = (gpu_type, after)
            self._by_size.setdefault(key, set()).add(node)
            heapq.heappush(self._smallest.setdefault(key, []), node)


# (id of a snapshot's node tuple, pools) -> (the tuple, its view with every GPU free).
_EMPTY: dict[tuple[int, tuple], tuple[tuple, FreeGpus]] = {}
_EMPTY_LOCK = threading.Lock()
_EMPTY_KEPT = 16

# GPU index tuples -> their bit sets, and (free set, count) -> the lowest free GPUs: both repeat
# round after round (a node has a few GPUs), so they are computed once.
_BITS: dict[tuple[int, ...], int | None] = {}
_LOWEST: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
_MEMO_KEPT = 100_000


def _ascending(indices: tuple[int, ...]) -> bool:
    return all(a < b for a, b in zip(indices, indices[1:])) if len(indices) > 1 else True


def _bits(indices: Iterable[int]) -> int | None:
    """The bit set of GPU ``indices`` (None if one repeats or is negative)."""
    key = indices if isinstance(indices, tuple) else tuple(indices)
    bits = _BITS.get(key, 0)
    if bits != 0 or not key:
        return bits
    for index in key:
        if index < 0 or (bits >> index) & 1:
            bits = None
            break
        bits |= 1 << index
    if len(_BITS) < _MEMO_KEPT:
        _BITS[key] = bits
    return bits


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
                 keep_first: Callable[[str], bool] = lambda node: False, job: JobInfo | None = None) -> Placement | None:
    """The job's current GPUs (or a subset when it shrinks), if all are still free and, for a
    ``job`` that requests cores or memory, its nodes still have room for the ranks it keeps.

    Shrinking keeps survivors on nodes where ``keep_first(node)`` holds first (DeepBoot keeps
    training-pool GPUs and gives lent ones back), then where the job has the most GPUs (fewest nodes).
    """
    if current is None or not current.placement or count > current.gpus:
        return None
    placement = current.placement
    if len(placement) == 1 and count == current.gpus and (job is None or not job.has_requests):
        # Most running jobs, every round: one node, all of it kept, nothing requested.
        node, indices = placement[0]
        taken = free.take(node, indices)
        return None if taken is None else ((node, taken),)
    # Every GPU still free, none named twice (a malformed plan: place afresh).
    if len(placement) > 1 and len({node for node, _ in placement}) != len(placement):
        held = [(node, index) for node, indices in placement for index in indices]
        if len(set(held)) != len(held):
            return None
    if not all(free.has(node, indices) for node, indices in placement):
        return None
    requests = job is not None and (job.cpus_per_rank or job.memory_bytes_per_rank)
    if count == current.gpus:  # keeps everything: no survivors to choose (most running jobs, every round)
        if not requests:
            return tuple(sorted((node, free.reserve(node, indices)) for node, indices in placement if indices))
        kept = [(node, indices) for node, indices in placement if indices]
    else:
        kept, remaining = [], count
        for node, indices in sorted(placement, key=lambda p: (not keep_first(p[0]), -len(p[1]), p[0])):
            if remaining == 0:
                break
            kept.append((node, indices[:remaining]))
            remaining -= len(kept[-1][1])
    if requests:
        if not free.room.fits(job, kept):
            return None
        free.room.take(job, kept)
    return tuple(sorted((node, free.reserve(node, indices)) for node, indices in kept))


def fresh_placement(job: JobInfo, count: int, free: FreeGpus, cache: Mapping[str, float],
                    gpu_type: str | None = None) -> Placement | None:
    """New GPUs for ``job``, on nodes of ``gpu_type`` (None: any node, types mixed);
    ``cache`` maps nodes to bytes of the job's dataset they hold."""
    if (free.total if gpu_type is None else free.total_of(gpu_type)) < count:
        return None
    if job.cpus_per_rank or job.memory_bytes_per_rank:  # only nodes with room for its ranks: the slower path
        return rank_requests.fresh_placement(job, count, free, cache, gpu_type)
    # One node if possible: prefer the dataset's cache, then the tightest fit.
    cached = [n for n in cache if free.count(n) >= count and (gpu_type is None or free.type_of(n) == gpu_type)] \
        if cache else None
    best = min(cached, key=lambda n: (-cache[n], free.count(n), n)) if cached else free.tightest(count, gpu_type)
    if best is not None:
        return ((best, free.reserve_any(best, count)),)
    if not cache:
        return _spread(count, free, gpu_type)
    sizes = free.counts(gpu_type)
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
    preferences: Mapping[str, Sequence[str]] | None = None,
) -> PlacementResult:
    """Place every job with a positive count in ``gpu_counts``, each on one GPU type.

    Jobs that can stay on (a subset of) their current GPUs, of a type they may use, are
    placed first, so running jobs are not moved to make room; the rest follow ``order``
    (default: the order of ``gpu_counts``; jobs that ``order`` omits come after it), each on
    the first type of its ``preferences`` (default :func:`type_preferences`) with room. A job
    whose count does not fit (its GPUs, or the cores and memory its ranks request) gets
    nothing and is listed in ``unplaced``: the policy decides what to do with the room left
    (often nothing).
    """
    pools = tuple(pools)
    free = FreeGpus(snapshot, pools)
    jobs = {job.job_id: job for job in snapshot.jobs}
    wanted = {job_id: n for job_id, n in gpu_counts.items() if n > 0}
    if preferences is None:
        preferences = type_preferences(snapshot, wanted, pools)
    placements: dict[str, Placement] = {}
    for job_id, count in wanted.items():
        current = snapshot.current.get(job_id)
        if current is None or not current.placement:
            continue
        if len(current.placement) == 1:  # most running jobs: one node, one type
            current_type = free.type_of(current.placement[0][0])
        else:
            current_types = {free.type_of(node) for node, _ in current.placement}
            if len(current_types) != 1:
                continue
            current_type = next(iter(current_types))
        if current_type not in preferences.get(job_id, ()):
            continue
        kept = keep_current(current, count, free, job=jobs.get(job_id))
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
        cached = cache.get(job.dataset, {}) if job.dataset else {}
        for gpu_type in preferences.get(job_id, ()):
            fresh = fresh_placement(job, wanted[job_id], free, cached, gpu_type)
            if fresh is not None:
                placements[job_id] = fresh
                break
        else:
            unplaced.append(job_id)
    return PlacementResult(placements, tuple(unplaced))


def _spread(count: int, free: FreeGpus, gpu_type: str | None) -> Placement:
    """:func:`fresh_placement` over several nodes with no cache to prefer: the largest holes
    (smallest name among equals) until the rest fits on one node, then the tightest node that
    holds the rest. Asked of the free view node by node, not by sorting every node with a free
    GPU (thousands on a large, nearly full cluster) for each job."""
    chosen: list[tuple[str, tuple[int, ...]]] = []
    remaining = count
    while remaining > 0:
        node = free.widest(gpu_type)
        if node is None:
            break
        size = free.count(node)
        if size >= remaining:
            last = free.tightest(remaining, gpu_type)
            chosen.append((last, free.reserve_any(last, remaining)))
            break
        chosen.append((node, free.reserve_any(node, size)))
        remaining -= size
    return tuple(sorted(chosen))


def plan_from_placements(placements: Mapping[str, Placement], batch_sizes: Mapping[str, int] | None = None,
                         snapshot: ClusterSnapshot | None = None) -> Plan:
    """A plan holding only GPUs (cache and IO unmanaged) — what GPU-only policies return.

    With ``snapshot`` each allocation names its GPU type.
    """
    batch_sizes = batch_sizes or {}
    kinds = node_types(snapshot) if snapshot is not None else {}
    jobs = {job.job_id: job for job in snapshot.jobs} if snapshot is not None else {}

    def type_of(job_id: str, p: Placement) -> str:
        if snapshot is None or not p:
            return ""
        return kinds.get(p[0][0], "") if len(p) == 1 else placement_type(p, kinds, jobs.get(job_id))

    current = snapshot.current.allocations if snapshot is not None else {}
    return Plan({job_id: gpu_allocation(current.get(job_id), p, batch_sizes.get(job_id, 0), type_of(job_id, p))
                 for job_id, p in placements.items()})


def gpu_allocation(current: Allocation | None, placement: Placement, batch_size: int, gpu_type: str) -> Allocation:
    """``Allocation(placement, batch_size, gpu_type)`` (no cache, IO unmanaged), or ``current``
    itself when it is exactly that: most jobs keep their allocation from round to round, and the
    object carries what was computed from it (its GPU count)."""
    if (current is not None and current.placement == placement and current.batch_size == batch_size
            and current.gpu_type == gpu_type and not current.cache_bytes and current.remote_io_bytes_per_s == UNLIMITED):
        return current
    return Allocation(placement=placement, batch_size=batch_size, gpu_type=gpu_type)
