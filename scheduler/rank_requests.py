"""Per-rank CPU and memory requests in placement: each node's room, the filter and the reserve.

A job may request cores and memory for each of its ranks (``JobInfo.cpus_per_rank``,
``memory_bytes_per_rank``); a node offers what it reports (``NodeInfo.cpus``, ``memory_bytes``:
UNLIMITED = no limit, 0 = nothing to give, as on a node whose agent does not report them). A
rank goes on a node only if the cores and memory not yet requested there — by the ranks this
round's plan already put on it, those kept where they run included — cover its request, and
placing it takes them (Kubernetes' resource fit, per rank). A job that requests neither (most
jobs) needs no room: :mod:`scheduler.placement` places it by GPUs alone on its fast paths, and
it never waits for cores or memory.

:class:`NodeRoom` keeps the room of one round's placement; :func:`fresh_placement` is
:func:`scheduler.placement.fresh_placement` for a job with requests; :func:`less_requested`
shows a policy nodes without what other runs of the same round already took
(:mod:`scheduler.quotas`); :func:`within_reach` bounds an elastic job by the ranks the
cluster could ever hold for it, so a policy does not choose, round after round, a count no
placement finds room for.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo

if TYPE_CHECKING:
    from scheduler.placement import FreeGpus, Placement

# Slack for sums of fractional cores (0.1 x 3 is 0.30000000000000004): far below any real request.
_SLACK = 1e-9


def ranks_within(left: float, per_rank: float) -> float:
    """How many ranks requesting ``per_rank`` fit in ``left`` (inf when nothing is requested)."""
    if per_rank <= 0 or left == math.inf:
        return math.inf
    return max(0, math.floor(left / per_rank + _SLACK))


class NodeRoom:
    """Cores and memory not yet requested on each node, for one round's placement.

    Only jobs with requests ever read or change it, so a round without them never builds it.
    Two views of free GPUs over the same nodes share one (DeepBoot's lending keeps a training
    view and a both-pools view in step): what a rank takes counts once.
    """

    __slots__ = ("_nodes", "_capacity", "_used")

    def __init__(self, nodes: Iterable[NodeInfo]) -> None:
        self._nodes = nodes
        self._capacity: dict[str, tuple[float, float]] | None = None  # built on first use
        self._used: dict[str, list[float]] = {}  # node -> [cores, bytes] requested so far

    def _left(self, node: str) -> tuple[float, float]:
        if self._capacity is None:
            self._capacity = {n.name: (n.cpus, n.memory_bytes) for n in self._nodes}
        cpus, memory = self._capacity.get(node, (0.0, 0.0))  # a node it does not know offers nothing
        used = self._used.get(node)
        return (cpus - used[0], memory - used[1]) if used is not None else (cpus, memory)

    def ranks_fit(self, node: str, job: JobInfo) -> float:
        """How many more ranks of ``job`` fit on ``node`` (inf when the job requests nothing)."""
        cpus, memory = self._left(node)
        return min(ranks_within(cpus, job.cpus_per_rank), ranks_within(memory, job.memory_bytes_per_rank))

    def fits(self, job: JobInfo, placement: Placement) -> bool:
        """Whether every node of ``placement`` has room for the job's ranks there."""
        return all(self.ranks_fit(node, job) >= ranks for node, ranks in _ranks_by_node(placement).items())

    def take(self, job: JobInfo, placement: Placement, sign: float = 1.0) -> None:
        """Count the requests of ``job``'s ranks of ``placement`` as taken (``sign`` -1: given back)."""
        if not job.has_requests:
            return
        for node, ranks in _ranks_by_node(placement).items():
            used = self._used.setdefault(node, [0.0, 0.0])
            used[0] += sign * ranks * job.cpus_per_rank
            used[1] += sign * ranks * job.memory_bytes_per_rank

    def give_back(self, job: JobInfo, placement: Placement) -> None:
        self.take(job, placement, -1.0)

    @classmethod
    def of_plan(cls, nodes: Iterable[NodeInfo], placements: Mapping[str, Placement],
                jobs: Mapping[str, JobInfo]) -> "NodeRoom":
        """The room left once the jobs of ``placements`` (job id -> placement) hold theirs."""
        room = cls(nodes)
        for job_id, placement in placements.items():
            job = jobs.get(job_id)
            if job is not None and job.has_requests:
                room.take(job, placement)
        return room


def _ranks_by_node(placement: Placement) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for node, indices in placement:
        ranks[node] = ranks.get(node, 0) + len(indices)
    return ranks


def fresh_placement(job: JobInfo, count: int, free: FreeGpus, cache: Mapping[str, float],
                    gpu_type: str | None = None) -> Placement | None:
    """:func:`scheduler.placement.fresh_placement` for a job that requests cores or memory:
    the same choice (one node if possible, the dataset's cache first, then the tightest fit;
    else the largest holes, then the tightest node for the rest) among the nodes with room for
    its ranks, each counted for as many ranks as both its free GPUs and its room hold."""
    room = free.room
    sizes: dict[str, int] = {}
    for node, gpus in free.counts(gpu_type).items():
        ranks = min(gpus, room.ranks_fit(node, job))
        if ranks > 0:
            sizes[node] = int(ranks)
    if sum(sizes.values()) < count:
        return None
    chosen: list[tuple[str, int]] = []
    holding = [n for n, size in sizes.items() if size >= count]
    if holding:
        chosen.append((min(holding, key=lambda n: (-cache.get(n, 0.0), free.count(n), n)), count))
    else:
        ranked = sorted(sizes, key=lambda n: (-sizes[n], -cache.get(n, 0.0), n))
        remaining = count
        for position, node in enumerate(ranked):
            if sizes[node] >= remaining:
                last = min((n for n in ranked[position:] if sizes[n] >= remaining),
                           key=lambda n: (-cache.get(n, 0.0), sizes[n], n))
                chosen.append((last, remaining))
                break
            chosen.append((node, sizes[node]))
            remaining -= sizes[node]
    placement = tuple(sorted((node, free.reserve_any(node, ranks)) for node, ranks in chosen))
    room.take(job, placement)
    return placement


def less_requested(nodes: tuple[NodeInfo, ...], allocations: Mapping[str, Allocation],
                   jobs: Iterable[JobInfo]) -> tuple[NodeInfo, ...]:
    """``nodes`` with the cores and memory that the ranks of ``allocations`` request taken off:
    what a policy run on part of the round may still give (``nodes`` itself when none requests)."""
    by_id = {job.job_id: job for job in jobs if job.has_requests}
    used: dict[str, list[float]] = {}
    for job_id, allocation in allocations.items():
        job = by_id.get(job_id)
        if job is None:
            continue
        for node, ranks in _ranks_by_node(allocation.placement).items():
            taken = used.setdefault(node, [0.0, 0.0])
            taken[0] += ranks * job.cpus_per_rank
            taken[1] += ranks * job.memory_bytes_per_rank
    if not used:
        return nodes
    return tuple(dataclasses.replace(n, cpus=max(0.0, n.cpus - used[n.name][0]),
                                     memory_bytes=max(0.0, n.memory_bytes - used[n.name][1]))
                 if n.name in used else n for n in nodes)


def within_reach(snapshot: ClusterSnapshot) -> ClusterSnapshot:
    """``snapshot`` with each job that requests cores or memory held to the ranks the whole
    cluster could hold for it alone (``max_gpus`` at most the sum over nodes of what both their
    GPUs and their cores and memory hold). An elastic policy (pollux, gavel, deepboot) then sizes
    it to a count that can be placed; without this it may choose one that never fits and the job
    never runs. A job whose ``min_gpus`` is beyond that keeps its bounds (it cannot run), and jobs
    without requests are untouched (``snapshot`` itself when no job requests anything)."""
    if not _any_requests(snapshot):
        return snapshot
    shapes = Counter((node.gpus, node.cpus, node.memory_bytes) for node in snapshot.nodes)
    jobs, changed = [], False
    for job in snapshot.jobs:
        if job.has_requests:
            reach = sum(count * min(gpus, ranks_within(cpus, job.cpus_per_rank),
                                    ranks_within(memory, job.memory_bytes_per_rank))
                        for (gpus, cpus, memory), count in shapes.items())
            if job.min_gpus <= reach < job.max_gpus:
                job, changed = dataclasses.replace(job, max_gpus=int(reach)), True
        jobs.append(job)
    return dataclasses.replace(snapshot, jobs=tuple(jobs)) if changed else snapshot


# The jobs of the last snapshot asked about that request cores or memory, with its jobs tuple:
# followed by the next snapshot's hint (ClusterSnapshot.jobs_changed) instead of a look at each
# of 20,000 jobs every round. One pair, replaced whole: a thread reads either the old or the new.
_REQUESTING: tuple[tuple | None, frozenset[str]] = (None, frozenset())


def _any_requests(snapshot: ClusterSnapshot) -> bool:
    global _REQUESTING
    seen, requesting = _REQUESTING
    hint = snapshot.jobs_changed
    if hint is not None and seen is not None and hint.follows(seen, snapshot.jobs):
        if hint.entries:
            ids = set(requesting)
            for job_id, job in hint.entries.items():
                ids.discard(job_id)
                if job is not None and job.has_requests:
                    ids.add(job_id)
            requesting = frozenset(ids)
    else:
        requesting = frozenset(job.job_id for job in snapshot.jobs if job.has_requests)
    _REQUESTING = (snapshot.jobs, requesting) if type(snapshot.jobs) is tuple else (None, frozenset())
    return bool(requesting)
