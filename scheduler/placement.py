"""Turn per-job GPU counts into concrete GPUs: hard filters, scores, then reserve.

Policies decide *how many* GPUs each job gets (and its batch size); this module decides
*which* ones, the same way for every policy (the Kubernetes scheduler framework's split of
Filter / Score / Reserve):

- filter: nodes of an allowed pool with enough free GPUs, of one GPU type (below);
- score: keep a job where it already runs (a move costs a restart and its local cache),
  then nodes that already cache the job's dataset, then the tightest fit (packing keeps
  large holes free for large jobs and keeps a job on few nodes, where it syncs fastest);
- reserve: take the GPU indices, so no GPU is ever handed out twice.

**GPU types: one type per job.** Every placement :func:`place` makes is on nodes of a single
GPU type: a data-parallel job steps in lockstep, so ranks on a faster type would wait for
the slowest one, and its throughput model (:mod:`estimator.gpu_types`) is per type. The type
is the first of the job's ``preferences`` (the policy names them, e.g. Gavel's LP) whose
nodes have room for the whole count; without preferences, :func:`type_preferences` ranks
the types the job allows (``JobInfo.gpu_types``) by the job's predicted goodput on them at
that count — the fastest type with room. Untyped nodes (``gpu_type`` "") form one type of
their own, so a homogeneous cluster places exactly as before. DeepBoot's lending
(:mod:`scheduler.deepboot.lending`) keeps a typed job on lent GPUs of its own type. A plan
that mixes types anyway is charged its job's slowest type (:func:`slowest_type`).
"""

from __future__ import annotations

import heapq
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


from scheduler.policy import UNLIMITED, Allocation, ClusterSnapshot, JobInfo, Plan, Pool

Placement = tuple[tuple[str, tuple[int, ...]], ...]


class FreeGpus:
    """Free GPU indices per node; ``reserve`` is the only way to take one.

    A node's free GPUs are the set bits of an integer (bit i: GPU i is free), so checking and
    taking a job's GPUs are a few integer operations rather than list scans.
    """

    def __init__(self, snapshot: ClusterSnapshot, pools: Iterable[Pool] = ("training",)):
        pools = tuple(pools)
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
        self._mask, self._size, self._type = dict(other._mask), dict(other._size), other._type  # types never change
        self._total, self._total_by_type = other._total, dict(other._total_by_type)
        self._by_size = {key: set(names) for key, names in other._by_size.items()}
        self._smallest = {key: list(heap) for key, heap in other._smallest.items()}
        self._types, self._widest = other._types, other._widest

    def _build(self, nodes, pools: tuple[Pool, ...]) -> None:
        allowed = set(pools)
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
        types = self._types if gpu_type is None else (gpu_type,)
        by_size = self._by_size
        # Sizes upwards: the first size any node of the types has is the tightest fit.
        for size in range(max(count, 1), self._widest + 1):
            best: str | None = None
            for kind in types:
                names = by_size.get((kind, size))
                if names:
                    heap = self._smallest[(kind, size)]
                    while heap[0] not in names:
                        heapq.heappop(heap)
                    if best is None or heap[0] < best:
                        best = heap[0]
            if best is not None:
                return best
        return None

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
                 keep_first: Callable[[str], bool] = lambda node: False) -> Placement | None:
    """The job's current GPUs (or a subset when it shrinks), if all are still free.

    Shrinking keeps survivors on nodes where ``keep_first(node)`` holds first (DeepBoot keeps
    training-pool GPUs and gives lent ones back), then where the job has the most GPUs (fewest nodes).
    """
    if current is None or not current.placement or count > current.gpus:
        return None
    placement = current.placement
    # Every GPU still free, none named twice (a malformed plan: place afresh).
    if len({node for node, _ in placement}) != len(placement):
        held = [(node, index) for node, indices in placement for index in indices]
        if len(set(held)) != len(held):
            return None
    if not all(free.has(node, indices) for node, indices in placement):
        return None
    if count == current.gpus:  # keeps everything: no survivors to choose (most running jobs, every round)
        return tuple(sorted((node, free.reserve(node, indices)) for node, indices in placement if indices))
    kept: list[tuple[str, tuple[int, ...]]] = []
    remaining = count
    for node, indices in sorted(placement, key=lambda p: (not keep_first(p[0]), -len(p[1]), p[0])):
        if remaining == 0:
            break
        take = indices[:remaining]
        kept.append((node, free.reserve(node, take)))
        remaining -= len(take)
    return tuple(sorted(kept))


def fresh_placement(job: JobInfo, count: int, free: FreeGpus, cache: Mapping[str, float],
                    gpu_type: str | None = None) -> Placement | None:
    """New GPUs for ``job``, on nodes of ``gpu_type`` (None: any node, types mixed);
    ``cache`` maps nodes to bytes of the job's dataset they hold."""
    if (free.total if gpu_type is None else free.total_of(gpu_type)) < count:
        return None
    # One node if possible: prefer the dataset's cache, then the tightest fit.
    cached = [n for n in cache if free.count(n) >= count and (gpu_type is None or free.type_of(n) == gpu_type)]
    best = min(cached, key=lambda n: (-cache[n], free.count(n), n)) if cached else free.tightest(count, gpu_type)
    if best is not None:
        return ((best, free.reserve_any(best, count)),)
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


def type_preferences(
    snapshot: ClusterSnapshot,
    gpu_counts: Mapping[str, int],
    pools: Iterable[Pool] = ("training",),
) -> dict[str, tuple[str, ...]]:
    """Per job of ``gpu_counts``: the GPU types of ``pools`` it allows, fastest first.

    Fastest = the job's predicted goodput on the type at its count (packed, its own batch
    size, IO unlimited), one vectorized prediction for every (job, type). Ties (and a
    homogeneous cluster) keep the types' sorted order.
    """
    types = snapshot.gpu_types(tuple(pools))
    jobs = {job.job_id: job for job in snapshot.jobs}
    ids = [job_id for job_id, n in gpu_counts.items() if n > 0 and job_id in jobs]
    if len(types) <= 1:
        return {job_id: tuple(t for t in types if jobs[job_id].allows(t)) for job_id in ids}
    per_node = max(node.gpus for node in snapshot.nodes if node.pool in tuple(pools))
    keys = [(id(jobs[j].model), id(jobs[j].type_models), jobs[j].gpu_types, gpu_counts[j], jobs[j].initial_batch_size,
             per_node, types) for j in ids]
    missing = {key: j for j, key in zip(ids, keys) if key not in _RANKED}
    if missing:
        _rank_types(missing, jobs, gpu_counts, per_node, types)
    kinds = node_types(snapshot)
    result = {}
    for job_id, key in zip(ids, keys):
        ranked = _RANKED[key][0]
        # A running job stays on its type first: moving costs a restart and its cache.
        running = _single_type(snapshot.current.get(job_id), kinds)
        if running is not None and ranked and running != ranked[0] and running in ranked:
            ranked = (running, *(t for t in ranked if t != running))
        result[job_id] = ranked
    return result


# (job model and type models by identity, allowed types, count, batch, GPUs per node, the
# pool's types) -> (the allowed types by goodput there, fastest first; the models, so that
# their ids are not reused while the entry lives).
_RANKED: dict[tuple, tuple[tuple[str, ...], tuple]] = {}
_RANKED_KEPT = 100_000


def _rank_types(missing: Mapping[tuple, str], jobs: Mapping[str, JobInfo], gpu_counts: Mapping[str, int],
                per_node: int, types: tuple[str, ...]) -> None:
    """Rank the types of one job per key of ``missing`` into ``_RANKED`` (ties by name), with one
    vectorized prediction for every (job, type)."""
    from scheduler.policies.pollux_estimates import packed_goodput  # deferred: the estimator is heavy

    pairs = [(key, jobs[j], t) for key, j in missing.items() for t in types if jobs[j].allows(t)]
    rate = packed_goodput([job.model_on(t) for _, job, t in pairs], [gpu_counts[job.job_id] for _, job, _ in pairs],
                          [job.initial_batch_size for _, job, _ in pairs], per_node=per_node).tolist()
    options: dict[tuple, list[tuple[float, str]]] = {key: [] for key in missing}
    for (key, _, gpu_type), r in zip(pairs, rate):
        options[key].append((-r, gpu_type))
    if len(_RANKED) + len(missing) > _RANKED_KEPT:
        _RANKED.clear()
    for key, job_id in missing.items():
        job = jobs[job_id]
        _RANKED[key] = (tuple(t for _, t in sorted(options[key])), (job.model, job.type_models))


def _single_type(allocation: Allocation | None, kinds: Mapping[str, str]) -> str | None:
    """The one GPU type of ``allocation``'s nodes (None: no placement, or nodes of several types)."""
    if allocation is None or not allocation.placement:
        return None
    types = {kinds.get(node) for node, _ in allocation.placement}
    return next(iter(types)) if len(types) == 1 else None


class TypeRoom:
    """Unclaimed GPUs per GPU type, for policies that decide counts before placing them.

    Counting the pool's total is not enough on a typed cluster: a count that fits the total
    may fit no single type. ``claim`` takes a job's whole count from the first type of its
    preferences with room and says which, so the placement can be told the same type.
    """

    def __init__(self, snapshot: ClusterSnapshot, pools: Iterable[Pool] = ("training",), capacity: int | None = None):
        self.room: dict[str, int] = {}
        for node in snapshot.nodes:
            if node.pool in tuple(pools):
                self.room[node.gpu_type] = self.room.get(node.gpu_type, 0) + node.gpus
        self.left = sum(self.room.values()) if capacity is None else capacity
        self._unclaimed = sum(self.room.values())  # kept by claim: asked for every job of a round

    @property
    def total(self) -> int:
        return max(0, min(self.left, self._unclaimed))

    def fits(self, count: int, preferences: Sequence[str]) -> str | None:
        if count > self.left:
            return None
        return next((t for t in preferences if self.room.get(t, 0) >= count), None)

    def claim(self, count: int, preferences: Sequence[str]) -> str | None:
        """Take ``count`` GPUs of the first type in ``preferences`` with room; that type, or None."""
        gpu_type = self.fits(count, preferences)
        if gpu_type is not None:
            self.room[gpu_type] -= count
            self.left -= count
            self._unclaimed -= count
        return gpu_type


def blind_preferences(snapshot: ClusterSnapshot, job_ids: Iterable[str],
                      pools: Iterable[Pool] = ("training",)) -> dict[str, tuple[str, ...]]:
    """Per job: the pool's types in an order that ignores speed — what a type-agnostic
    scheduler amounts to. The order is a fixed pseudo-random one per job (a hash of its id
    and the type), so jobs spread over the types instead of all landing on the first name."""
    types = snapshot.gpu_types(tuple(pools))
    jobs = {job.job_id: job for job in snapshot.jobs}
    return {job_id: tuple(sorted((t for t in types if job_id not in jobs or jobs[job_id].allows(t)),
                                 key=lambda t: zlib.crc32(f"{job_id}/{t}".encode())))
            for job_id in job_ids}


def largest_type_gpus(snapshot: ClusterSnapshot, pools: Iterable[Pool] = ("training",)) -> int:
    """GPUs of the largest GPU type of ``pools``: the most any one job can hold."""
    by_type: dict[str, int] = {}
    for node in snapshot.nodes:
        if node.pool in tuple(pools):
            by_type[node.gpu_type] = by_type.get(node.gpu_type, 0) + node.gpus
    return max(by_type.values(), default=0)


def slowest_type(job: JobInfo, gpu_types: Iterable[str]) -> str:
    """The type among ``gpu_types`` on which ``job`` computes slowest (what a job spanning types runs at)."""
    def step_time(gpu_type: str) -> float:
        perf = job.model_on(gpu_type).perf
        return perf.alpha_c + perf.beta_c * job.initial_batch_size
    return max(sorted(set(gpu_types)), key=step_time, default="")


def placement_type(placement: Placement, node_types: Mapping[str, str], job: JobInfo | None) -> str:
    """GPU type of ``placement`` (``node_types``: node -> type): its nodes' type, or, if they
    mix, the job's slowest among them ("" without a job)."""
    types = {node_types.get(node, "") for node, _ in placement}
    if len(types) == 1:
        return next(iter(types))
    return slowest_type(job, types) if job is not None else ""


def node_types(snapshot: ClusterSnapshot) -> Mapping[str, str]:
    """Node name -> GPU type (read-only: one mapping per node tuple, shared by the rounds that use it)."""
    found = _KINDS.get(id(snapshot.nodes))
    if found is not None and found[0] is snapshot.nodes:
        return found[1]
    kinds = {node.name: node.gpu_type for node in snapshot.nodes}
    with _EMPTY_LOCK:
        if len(_KINDS) >= _EMPTY_KEPT:
            _KINDS.pop(next(iter(_KINDS)))
        _KINDS[id(snapshot.nodes)] = (snapshot.nodes, kinds)  # the entry holds the tuple: its id stays its own
    return kinds


_KINDS: dict[int, tuple[tuple, dict[str, str]]] = {}


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
    whose count does not fit gets nothing and is listed in ``unplaced``: the policy decides
    what to do with the room left (often nothing).
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
        current_types = {free.type_of(node) for node, _ in current.placement}
        if len(current_types) != 1 or next(iter(current_types)) not in preferences.get(job_id, ()):
            continue
        kept = keep_current(current, count, free)
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
