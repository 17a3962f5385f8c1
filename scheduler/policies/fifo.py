"""FIFO: jobs in arrival order get their requested GPUs while they fit; nobody is preempted.

The reference policy and the simplest baseline, rigid like the other queue-based policies:
a job gets ``job.requested`` GPUs (its request clamped to ``[min_gpus, max_gpus]``) or
none. A running job keeps the GPUs it holds until it finishes (FIFO never preempts), and a
waiting job that does not fit blocks the ones behind it unless ``backfill`` lets later jobs
use the GPUs it cannot. Only training-pool GPUs are handed out.

With ``codesign`` (SiloD) cache and IO are granted with the GPUs
(:func:`scheduler.codesign.co_allocate`), and a job the IO grants would starve is passed
over like a job that does not fit (FIFO still never preempts a job that is running).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import codesign as co
from scheduler.placement import FreeGpus, place, plan_from_placements
from scheduler.policy import ClusterSnapshot, Plan
from scheduler.registry import register


@register("fifo")
@dataclass(frozen=True)
class FifoPolicy:
    backfill: bool = True  # let later jobs use GPUs the head of the queue cannot
    codesign: bool = False  # SiloD: grant cache and IO with the GPUs (scheduler.codesign)

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if self.codesign and co.is_active(snapshot):
            return co.without_starved(snapshot, lambda excluded: self._admit(snapshot, excluded))
        placements, _ = self._admit(snapshot, frozenset())
        return plan_from_placements(placements)

    def _admit(self, snapshot: ClusterSnapshot, excluded: frozenset[str]):
        """``(placements, arrival order)``; jobs in ``excluded`` are passed over unless running."""
        free = FreeGpus(snapshot).total
        counts: dict[str, int] = {}
        # Running jobs keep what they hold (within their bounds).
        for job in snapshot.jobs:
            held = snapshot.current.gpus_of(job.job_id)
            if held:
                counts[job.job_id] = min(max(held, job.min_gpus), job.max_gpus)
                free -= counts[job.job_id]
        order = sorted(snapshot.jobs, key=lambda j: (j.submit_time_s, j.job_id))
        for job in order:
            if job.job_id in counts or job.job_id in excluded:
                continue
            if job.requested > free:
                if not self.backfill:
                    break
                continue
            counts[job.job_id] = job.requested
            free -= job.requested
        result = place(snapshot, counts, [j.job_id for j in order])
        return result.placements, [j.job_id for j in order if j.job_id in result.placements]
