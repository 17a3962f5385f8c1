"""How a gavel round hands out GPUs once the LP has answered: a job's first candidate that has
room (:func:`pick`), leftover GPUs for a job the round passed over (:func:`fill`), and the batch
sizes of the jobs placed (:func:`batch_sizes`). The order of the jobs and the admission loop are
:meth:`scheduler.policies.gavel.GavelPolicy.schedule`'s."""

from __future__ import annotations

import numpy as np

from scheduler.placement import TypeRoom, node_types, placement_type
from scheduler.policies.gavel_allocation import GavelAllocation
from scheduler.policies.pollux_estimates import JobTable, gpus_per_node
from scheduler.policy import ClusterSnapshot, JobInfo


def pick(job: JobInfo, allocation: GavelAllocation, candidates: list[int], room: TypeRoom,
         blind: dict[str, tuple[str, ...]] | None, elastic: bool) -> tuple[int, tuple[str, ...]] | None:
    """The job's first candidate whose type has room for its count, claimed: ``(count, (type,))``.

    An elastic job whose candidates do not fit takes what is left of its preferred type,
    down to its minimum. Type-blind, a candidate's count may go to any type, in the job's
    speed-blind order (:func:`scheduler.placement.blind_preferences`).
    """
    def types_of(c: int) -> tuple[str, ...]:
        return blind[job.job_id] if blind is not None else (allocation.type_of(c),)

    for c in candidates:
        want = int(allocation.gpus[c])
        gpu_type = room.claim(want, tuple(t for t in types_of(c) if job.allows(t)))
        if gpu_type is not None:
            return want, (gpu_type,)
    if elastic and not job.rigid:
        first = candidates[0]
        for gpu_type in (t for t in types_of(first) if job.allows(t)):
            left = min(room.room.get(gpu_type, 0), room.left, int(allocation.gpus[first]))
            if left >= job.min_gpus and room.claim(left, (gpu_type,)) is not None:
                return left, (gpu_type,)
    return None

def fill(job: JobInfo, allocation: GavelAllocation, fastest: list[int], room: TypeRoom,
         blind: dict[str, tuple[str, ...]] | None, elastic: bool, max_gpus_per_job: int) -> tuple[int, tuple[str, ...]] | None:
    """Leftover GPUs for a job the round passed over: its candidates ``fastest`` first, each
    on its type (any type in the blind order, type-blind), else (elastic) what a type has left."""
    for c in fastest:
        types = blind[job.job_id] if blind is not None else (allocation.type_of(c),)
        gpu_type = room.claim(int(allocation.gpus[c]), tuple(t for t in types if job.allows(t)))
        if gpu_type is not None:
            return int(allocation.gpus[c]), (gpu_type,)
    if elastic and not job.rigid:
        for gpu_type in sorted(room.room, key=lambda t: -room.room[t]):
            left = min(room.room[gpu_type], room.left, job.max_gpus, max_gpus_per_job)
            if job.allows(gpu_type) and left >= job.min_gpus and room.claim(left, (gpu_type,)) is not None:
                return left, (gpu_type,)
    return None

def batch_sizes(snapshot: ClusterSnapshot, placements) -> dict[str, int]:
    """Each placed job's goodput-optimal batch size on the GPUs and nodes it got (``adapt_batch``)."""
    if not placements:
        return {}
    jobs = [job for job in snapshot.jobs if job.job_id in placements]
    kinds = node_types(snapshot)
    table = JobTable(jobs, gpu_types=[placement_type(placements[job.job_id], kinds, job) for job in jobs])
    gpus = [sum(len(ix) for _, ix in placements[job.job_id]) for job in jobs]
    nodes = [len(placements[job.job_id]) for job in jobs]
    batch = table.predict(np.arange(len(jobs)), gpus, nodes, per_node=gpus_per_node(snapshot)).batch_size
    return {job.job_id: int(b) for job, b in zip(jobs, batch)}
