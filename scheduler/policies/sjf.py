"""SJF: shortest estimated remaining time first (SRPT when preemptive), rigid and gang-scheduled.

Each job is ranked by its estimated remaining time ``r`` on its requested GPUs, packed on as few
nodes as they allow (:func:`scheduler.policies.estimates.remaining_time_s`: remaining
efficiency-weighted samples / predicted goodput, GPU-only), whether it runs or waits: a waiting
job can only be priced on its best placement, and a running job priced on the nodes it got would
fall behind the waiting jobs it was placed before. Jobs are then admitted in that order, each getting
``job.requested`` GPUs or none (:func:`~scheduler.policies.estimates.admit_in_order`, so a
job that does not fit is skipped and smaller ones behind it may backfill).

Preemptive (default): every job, running or not, competes each round; a job that is not
already running on its requested GPUs is ranked by ``r + restart_cost_s`` (it has to start,
or restart, before it makes progress), a job running in place by ``r``. So a waiting job S
overtakes — and may preempt — a running job L only when ``r_S + restart_cost_s < r_L``.
That is exactly when preempting lowers the two jobs' total completion time: running S first
finishes them at ``r_S`` and ``r_S + restart_cost_s + r_L``, letting L finish first at
``r_L`` and ``r_L + r_S``; the first sum is smaller iff ``r_S + restart_cost_s < r_L``. A gain
below the restart cost never causes a preemption, which keeps near-equal jobs from
thrashing. (As a running job's ``r`` only shrinks, it is never preempted by a job that was
already waiting when it started, unless estimates change.)

Non-preemptive (``preemptive=False``): jobs holding GPUs keep running (on their requested
count) and waiting jobs fill the remaining GPUs in SJF order.

Ties: larger ``priority`` first, then arrival, then job id.

Preemptive sjf keeps its ranked jobs between calls (:mod:`scheduler.policies.ranked_queue`) and
answers from them where that gives the plan of a whole pass, which is then the exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler import codesign as co
from scheduler.policies.estimates import in_place, remaining_time_s, rigid_plan, sorted_by
from scheduler.policies.ranked_queue import RankedQueue
from scheduler.policy import ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register
from scheduler.steady import FOREVER, FOREVER_DEPARTURES, NO_PROMISE, Steadiness, everyone_holds_requested, unchanged


@register("sjf")
@dataclass(frozen=True)
class SjfPolicy:
    preemptive: bool = True  # a shorter job may take a running job's GPUs (gain must beat the restart cost)
    codesign: bool = False  # SiloD: price jobs with T(g, c, b), grant cache and IO with the GPUs (scheduler.codesign)

    def __post_init__(self) -> None:
        # What the last call worked out, used where it gives the same plan as a whole pass
        # (scheduler.policies.ranked_queue). Not an option (no field): a copy starts without it.
        object.__setattr__(self, "ranked", RankedQueue())

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if not snapshot.jobs:
            return Plan()
        if self.preemptive and not (self.codesign and co.is_active(snapshot)):
            return self.ranked.schedule(snapshot, _packed_remaining, _preemptive_keys, self._whole_pass)
        return self._whole_pass(snapshot)

    def _whole_pass(self, snapshot: ClusterSnapshot) -> Plan:
        jobs = snapshot.jobs
        remaining = _packed_remaining(snapshot, jobs, codesign=self.codesign)
        if self.preemptive:
            key = _preemptive_keys(snapshot, remaining, in_place(snapshot, jobs))
            return rigid_plan(snapshot, sorted_by(jobs, key), codesign=self.codesign)
        # Running jobs first (in SJF order among themselves), then the waiting ones.
        order = sorted_by(jobs, remaining)
        running = [job for job in order if snapshot.current.gpus_of(job.job_id) > 0]
        waiting = [job for job in order if snapshot.current.gpus_of(job.job_id) == 0]
        return rigid_plan(snapshot, running + waiting, codesign=self.codesign)

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """See scheduler.steady. While every job runs on its request nobody waits, and no order
        changes the plan. A fixed point (the plan in force kept) holds until an arrival or a
        departure: a waiting job's estimate does not move, a running job's only shrinks, so a
        running job only moves up the order and a job that did not fit still does not."""
        if self.codesign and co.is_active(snapshot):
            return NO_PROMISE
        if everyone_holds_requested(snapshot, plan):
            return FOREVER_DEPARTURES
        return FOREVER if unchanged(snapshot, plan) else NO_PROMISE


def _packed_remaining(snapshot: ClusterSnapshot, jobs: Sequence[JobInfo], codesign: bool = False) -> np.ndarray:
    """Every job priced packed, running or not: a waiting job's estimate can only assume its best
    placement, and a running job priced on the nodes it was spread over would rank below the
    waiting jobs it had ranked above, be preempted, rank above them again once waiting (packed),
    and so on round after round."""
    return remaining_time_s(snapshot, jobs, nodes=np.zeros(len(jobs), dtype=np.int64), codesign=codesign)


def _preemptive_keys(snapshot: ClusterSnapshot, remaining: np.ndarray, runs_in_place: np.ndarray) -> np.ndarray:
    """A job not running in place has to start, or restart, before it makes progress."""
    return remaining + np.where(runs_in_place, 0.0, snapshot.restart_cost_s)
