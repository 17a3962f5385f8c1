"""Which GPU type a job's count goes on: every job runs on GPUs of one type.

A data-parallel job steps in lockstep, so ranks on a faster type would wait for the slowest
one, and its throughput model (:mod:`estimator.gpu_types`) is per type. :func:`type_preferences`
ranks the types a job allows by its predicted goodput on them (a running job's own type
first); :class:`TypeRoom` lets a policy claim counts per type before :func:`scheduler.placement.place`
turns them into GPUs; :func:`blind_preferences` is the speed-blind order of a type-agnostic
scheduler; :func:`placement_type` and :func:`slowest_type` name the type a placement runs at.
Untyped nodes (``gpu_type`` "") form one type of their own.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from scheduler.node_memo import of_nodes
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Pool

if TYPE_CHECKING:
    from scheduler.placement import Placement



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
        self.room: dict[str, int] = dict(gpus_by_type(snapshot, pools))
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
    return max(gpus_by_type(snapshot, pools).values(), default=0)


def gpus_by_type(snapshot: ClusterSnapshot, pools: Iterable[Pool] = ("training",)) -> Mapping[str, int]:
    """GPU type -> GPUs of the nodes of ``pools``, types in the order of their first node
    (read-only: one mapping per node tuple and pools, shared by the rounds that ask)."""
    pools = tuple(pools)

    def by_type(nodes: tuple[NodeInfo, ...]) -> dict[str, int]:
        gpus: dict[str, int] = {}
        for node in nodes:
            if node.pool in pools:
                gpus[node.gpu_type] = gpus.get(node.gpu_type, 0) + node.gpus
        return gpus

    return of_nodes(snapshot.nodes, ("gpus_by_type", pools), by_type)


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
    return of_nodes(snapshot.nodes, "node_types", lambda nodes: {node.name: node.gpu_type for node in nodes})


