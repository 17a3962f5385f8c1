"""FIFO: jobs in arrival order get their maximum GPUs while they fit; nobody is preempted.

The reference policy and the simplest baseline. A running job keeps its GPUs until it
finishes (FIFO never preempts), and a waiting job at the head of the queue blocks the ones
behind it only if not even its minimum fits (then later, smaller jobs may backfill).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.placement import place, plan_from_placements
from scheduler.policy import ClusterSnapshot, Plan
from scheduler.registry import register


@register("fifo")
@dataclass(frozen=True)
class FifoPolicy:
    backfill: bool = True  # let later jobs use GPUs the head of the queue cannot

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        free = snapshot.total_gpus
        counts: dict[str, int] = {}
        # Running jobs keep what they hold.
        for job in snapshot.jobs:
            held = snapshot.current.gpus_of(job.job_id)
            if held:
                counts[job.job_id] = held
                free -= held
        order = sorted(snapshot.jobs, key=lambda j: (j.submit_time_s, j.job_id))
        for job in order:
            if job.job_id in counts:
                continue
            if job.min_gpus > free:
                if not self.backfill:
                    break
                continue
            counts[job.job_id] = min(job.max_gpus, free)
            free -= counts[job.job_id]
        result = place(snapshot, counts, [j.job_id for j in order])
        return plan_from_placements(result.placements)
