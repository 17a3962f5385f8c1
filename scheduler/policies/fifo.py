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
from scheduler.placement import TypeRoom, type_preferences
from scheduler.policies.estimates import place_admitted
from scheduler.policies.fifo_queue import FifoQueue
from scheduler.policy import ClusterSnapshot, Plan
from scheduler.registry import register
from scheduler.steady import FOREVER, FOREVER_DEPARTURES, NO_PROMISE, Steadiness, everyone_placed, unchanged


@register("fifo")
@dataclass(frozen=True)
class FifoPolicy:
    backfill: bool = True  # let later jobs use GPUs the head of the queue cannot
    codesign: bool = False  # SiloD: grant cache and IO with the GPUs (scheduler.codesign)

    def __post_init__(self) -> None:
        # What the last call worked out, used where it gives the same plan as a whole pass
        # (scheduler.policies.fifo_queue). Not an option (no field): a copy starts without it.
        object.__setattr__(self, "queue", FifoQueue())

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if self.codesign and co.is_active(snapshot):
            return co.without_starved(snapshot, lambda excluded: self._admit(snapshot, excluded))
        return self.queue.schedule(snapshot, self.backfill, lambda s: dict(self._admit(s, frozenset())[0]))

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """FIFO reads no clock and no progress: its own plan shown back to it is kept until a job
        arrives or leaves (and while every job runs, also when one leaves). See scheduler.steady."""
        if self.codesign and co.is_active(snapshot):
            return NO_PROMISE
        if everyone_placed(snapshot, plan):  # running jobs keep what they hold; nobody waits
            return FOREVER_DEPARTURES
        return FOREVER if unchanged(snapshot, plan) else NO_PROMISE

    def _admit(self, snapshot: ClusterSnapshot, excluded: frozenset[str]):
        """``(placements, arrival order)``; jobs in ``excluded`` are passed over unless running."""
        room = TypeRoom(snapshot)
        wanted = {job.job_id: min(max(snapshot.current.gpus_of(job.job_id), job.min_gpus), job.max_gpus)
                  if snapshot.current.gpus_of(job.job_id) else job.requested for job in snapshot.jobs}
        # Running jobs first on their own type, the rest on the fastest type with room.
        preferences = type_preferences(snapshot, wanted)
        admitted: dict[str, tuple[int, str]] = {}
        # Running jobs keep what they hold (within their bounds).
        for job in snapshot.jobs:
            if snapshot.current.gpus_of(job.job_id):
                gpu_type = room.claim(wanted[job.job_id], preferences.get(job.job_id, ()))
                if gpu_type is not None:
                    admitted[job.job_id] = (wanted[job.job_id], gpu_type)
        order = sorted(snapshot.jobs, key=lambda j: (j.submit_time_s, j.job_id))
        for job in order:
            # A running job that cannot keep its count waits a round rather than restart at another.
            if job.job_id in admitted or job.job_id in excluded or snapshot.current.gpus_of(job.job_id):
                continue
            gpu_type = room.claim(job.requested, preferences.get(job.job_id, ()))
            if gpu_type is None:
                if not self.backfill:
                    break
                continue
            admitted[job.job_id] = (job.requested, gpu_type)
        result = place_admitted(snapshot, admitted, [j.job_id for j in order])
        return result.placements, [j.job_id for j in order if j.job_id in result.placements]
