"""Which GPUs training may use under DeepBoot, and how jobs are placed on them.

Training may use every training-pool GPU and every inference-pool GPU that no RUNNING or
PROTECT replica holds (``ClusterSnapshot.inference_busy``): free ones and those of SLEEP
replicas. :func:`place_lending` is :func:`scheduler.placement.place` over both pools with
the busy GPUs taken out, and it prefers the training pool: a job that needs new GPUs tries
the training pool before lent ones, and a job that shrinks gives its lent GPUs back first.
A job on lent GPUs is the one ATS-I shrinks when inference load returns, so lent GPUs are
used only when the training pool cannot hold the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from scheduler.placement import FreeGpus, Placement, PlacementResult, cache_by_dataset, fresh_placement, keep_current
from scheduler.policies.pollux_estimates import held_in_place
from scheduler.policy import ClusterSnapshot, JobInfo

BOTH_POOLS = ("training", "inference")


def busy_gpus(snapshot: ClusterSnapshot) -> dict[str, tuple[int, ...]]:
    """Inference-pool GPUs held by RUNNING/PROTECT replicas (entries naming unknown nodes or GPUs dropped)."""
    sizes = {node.name: node.gpus for node in snapshot.nodes if node.pool == "inference"}
    result = {}
    for node, indices in snapshot.inference_busy.items():
        valid = sorted({i for i in indices if node in sizes and 0 <= i < sizes[node]})
        if valid:
            result[node] = tuple(valid)
    return result


def lendable_gpus(snapshot: ClusterSnapshot) -> dict[str, tuple[int, ...]]:
    """Inference-pool GPUs training may use: node -> indices not busy."""
    busy = busy_gpus(snapshot)
    result = {}
    for node in snapshot.nodes:
        if node.pool == "inference":
            free = tuple(i for i in range(node.gpus) if i not in set(busy.get(node.name, ())))
            if free:
                result[node.name] = free
    return result


def training_capacity(snapshot: ClusterSnapshot, *, lend: bool = True) -> int:
    """GPUs ATS-T may hand out: the training pool, plus the lendable inference GPUs when ``lend``."""
    own = sum(node.gpus for node in snapshot.nodes if node.pool == "training")
    return own + (sum(map(len, lendable_gpus(snapshot).values())) if lend else 0)


def held_lendable(snapshot: ClusterSnapshot, jobs: Sequence[JobInfo]) -> np.ndarray:
    """GPUs each job holds now where it may stay (0 if its placement lost a node or touches a busy GPU)."""
    held = held_in_place(snapshot, jobs, BOTH_POOLS)
    busy = busy_gpus(snapshot)
    for k, job in enumerate(jobs):
        allocation = snapshot.current.get(job.job_id)
        if held[k] and any(set(indices) & set(busy.get(node, ())) for node, indices in allocation.placement):
            held[k] = 0
    return held


def place_lending(
    snapshot: ClusterSnapshot, gpu_counts: Mapping[str, int], order: Sequence[str] | None = None, *, lend: bool = True,
    types: Mapping[str, str] | None = None,
) -> PlacementResult:
    """Place every job with a positive count: stay in place first, then the training pool, then lent GPUs.

    Same contract as :func:`scheduler.placement.place` (jobs that do not fit are ``unplaced``);
    busy inference GPUs are never handed out. Without ``lend`` only the training pool is used.
    ``types`` (job id -> GPU type) keeps each named job on nodes of its type in both pools,
    so lent GPUs are of the job's type too; a job it omits may use any node.
    """
    types = types or {}
    pools = BOTH_POOLS if lend else ("training",)
    anywhere = FreeGpus(snapshot, pools)
    training = FreeGpus(snapshot, ("training",))
    training.share_room(anywhere)  # a rank's cores and memory are taken once, whichever view places it
    if lend:
        for node, indices in busy_gpus(snapshot).items():
            anywhere.reserve(node, indices)
    training_nodes = {node.name for node in snapshot.nodes if node.pool == "training"}

    def mirror(placement: Placement, into: FreeGpus, nodes) -> None:
        # Both views must agree on what is taken, or a GPU could be handed out twice.
        for node, indices in placement:
            if node in nodes:
                into.reserve(node, indices)

    jobs = {job.job_id: job for job in snapshot.jobs}
    wanted = {job_id: n for job_id, n in gpu_counts.items() if n > 0}
    placements: dict[str, Placement] = {}
    growing: dict[str, Placement] = {}  # jobs that grow: their current GPUs, kept (AFE scale-out adds workers)
    for job_id, count in wanted.items():
        current = snapshot.current.get(job_id)
        if job_id in types and current is not None and any(anywhere.type_of(n) != types[job_id] for n, _ in current.placement):
            continue  # it moves to another type: a fresh placement below
        grows = current is not None and count > current.gpus > 0
        kept = keep_current(current, current.gpus if grows else count, anywhere,
                            keep_first=lambda node: node in training_nodes, job=jobs.get(job_id))
        if kept is not None:
            mirror(kept, training, training_nodes)
            (growing if grows else placements)[job_id] = kept
    cache = cache_by_dataset(snapshot)
    everything = {node.name for node in snapshot.nodes}
    unplaced = []
    sequence = list(order) + list(wanted) if order is not None else list(wanted)
    for job_id in dict.fromkeys(sequence):
        if job_id in placements or job_id not in wanted:
            continue
        job = jobs[job_id]
        cached = cache.get(job.dataset, {}) if job.dataset else {}
        gpu_type = types.get(job_id)
        if job_id in growing:
            placements[job_id] = _grow(job, growing[job_id], wanted[job_id], training, anywhere, training_nodes,
                                       everything, cached, lend=lend, gpu_type=gpu_type)
            continue
        fresh = fresh_placement(job, wanted[job_id], training, cached, gpu_type)
        if fresh is not None:
            mirror(fresh, anywhere, everything)
        elif lend:
            fresh = fresh_placement(job, wanted[job_id], anywhere, cached, gpu_type)
            if fresh is not None:
                mirror(fresh, training, training_nodes)
        if fresh is None:
            unplaced.append(job_id)
        else:
            placements[job_id] = fresh
    return PlacementResult(placements, tuple(unplaced))


def _grow(job: JobInfo, kept: Placement, count: int, training: FreeGpus, anywhere: FreeGpus, training_nodes,
          everything, cached, *, lend: bool, gpu_type: str | None = None) -> Placement:
    """``kept`` (the job's current GPUs, already reserved) plus new GPUs up to ``count``.

    A growing job keeps its workers (with AFE only the new ones start, DeepBoot's scale-out);
    a fresh placement elsewhere would restart all of them. New GPUs come from the job's own
    nodes, then the training pool, then (lending) its own inference nodes, then lent GPUs, on
    nodes with room for the cores and memory its ranks request. If not all fit, the job gets
    what did (at least its current GPUs).
    """
    held: dict[str, list[int]] = {node: list(indices) for node, indices in kept}
    remaining = count - sum(map(len, held.values()))

    def add(placement: Placement) -> None:
        nonlocal remaining
        for node, indices in placement:
            held.setdefault(node, []).extend(indices)
            remaining -= len(indices)

    def on_own_nodes(pool_nodes, view: FreeGpus, other: FreeGpus | None) -> None:
        for node in sorted(held, key=lambda n: (-len(held[n]), n)):
            if remaining <= 0 or node not in pool_nodes or view.count(node) == 0:
                continue
            if gpu_type is not None and view.type_of(node) != gpu_type:
                continue
            ranks = min(remaining, view.count(node))
            if job.has_requests:  # no more ranks than the node has cores and memory for
                ranks = int(min(ranks, view.room.ranks_fit(node, job)))
                if ranks <= 0:
                    continue
            taken = view.reserve_any(node, ranks)
            if job.has_requests:
                view.room.take(job, ((node, taken),))
            if other is not None:
                other.reserve(node, taken)
            add(((node, taken),))

    on_own_nodes(training_nodes, training, anywhere)  # ``anywhere`` covers the training pool too: keep both views in step
    if remaining > 0:
        fresh = fresh_placement(job, remaining, training, cached, gpu_type)
        if fresh is not None:
            for node, indices in fresh:
                anywhere.reserve(node, indices)
            add(fresh)
    if remaining > 0 and lend:
        on_own_nodes(everything - set(training_nodes), anywhere, None)
        if remaining > 0:
            fresh = fresh_placement(job, remaining, anywhere, cached, gpu_type)
            if fresh is not None:
                for node, indices in fresh:
                    if node in training_nodes:
                        training.reserve(node, indices)
                add(fresh)
    return tuple(sorted((node, tuple(sorted(indices))) for node, indices in held.items()))
