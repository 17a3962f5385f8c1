"""Tiresias: discretized two-dimensional least-attained-service (2D-LAS), gang-scheduled.

Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep Learning", NSDI'19. A job's
attained service is GPUs x time (``JobInfo.attained_gpu_s``); it needs no estimate of the
job's length. Service is discretized into K priority queues by K-1 thresholds: a job sits
in queue ``q`` = the number of thresholds its attained service has reached (queue 0 on
arrival), so it is *demoted* as it runs. Each round jobs are ranked by queue (lower first),
then within a queue larger ``priority`` first and FIFO by arrival (then job id), and
admitted in that order with all their requested GPUs or none (gang scheduling; a job that
does not fit is skipped, later ones may backfill). A job in a higher queue therefore
preempts running jobs of lower queues — a new job preempts one that has been demoted.

Defaults follow the Pollux artifact's Tiresias (petuum/adaptdl, ``simulator/tiresias.py``),
the baseline whose published average JCT on workload-6 is 3,470 s (DESIGN.md): two queues,
one threshold of 16 GPU-hours (57,600 GPU-seconds), starvation handling off. The Tiresias
authors' simulator (SymbioticLab/Tiresias, ``dlas-gpu``) uses two queues at 3,250
GPU-seconds instead: ``TiresiasPolicy(thresholds_gpu_s=(3250.0,))``.

Starvation promotion (``starvation_factor`` = Tiresias's PROMOTEKNOB, > 0 to enable): a job
out of the top queue that has waited at least ``starvation_factor`` times as long as it has
run is treated as a top-queue job. The policy keeps no state, so it uses the snapshot's
totals — run time ``attained_gpu_s / requested GPUs`` and waiting time ``time since
arrival - run time`` — rather than the reference implementation's counters since the last
promotion. A promoted job therefore stays on top only until it has run for
``waiting time / starvation_factor``, after which it drops back to the queue its service
puts it in.

Without starvation promotion, tiresias keeps its ranked jobs between calls
(:mod:`scheduler.policies.ranked_queue`) and answers from them where that gives the plan of a
whole pass.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler import codesign as co
from scheduler.policies.estimates import rigid_plan, sorted_by
from scheduler.policies.ranked_queue import RankedQueue
from scheduler.policy import ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register
from scheduler.steady import (FOREVER_DEPARTURES, NO_PROMISE, Steadiness, everyone_holds_requested, threshold_crossing,
                              unchanged)

POLLUX_ARTIFACT_THRESHOLD_GPU_S = 3600.0 * 16  # petuum/adaptdl simulator/tiresias.py: _queue_threshold


@register("tiresias")
@dataclass(frozen=True)
class TiresiasPolicy:
    thresholds_gpu_s: tuple[float, ...] = (POLLUX_ARTIFACT_THRESHOLD_GPU_S,)  # K-1 ascending queue limits, GPU-seconds
    starvation_factor: float = 0.0  # promote when waited >= factor x run time; 0 = off
    codesign: bool = False  # SiloD: price jobs with T(g, c, b), grant cache and IO with the GPUs (scheduler.codesign)

    def __post_init__(self):
        thresholds = tuple(float(t) for t in self.thresholds_gpu_s)
        if any(not t > 0 for t in thresholds) or list(thresholds) != sorted(set(thresholds)):
            raise ValueError(f"thresholds_gpu_s must be positive and strictly increasing, got {self.thresholds_gpu_s}")
        if not self.starvation_factor >= 0:
            raise ValueError(f"starvation_factor must be >= 0, got {self.starvation_factor}")
        object.__setattr__(self, "thresholds_gpu_s", thresholds)
        # What the last call worked out, used where it gives the same plan as a whole pass
        # (scheduler.policies.ranked_queue). Not an option (no field): a copy starts without it.
        object.__setattr__(self, "ranked", RankedQueue())

    def queue(self, job: JobInfo, time_s: float) -> int:
        """The job's priority queue at ``time_s`` (0 = highest)."""
        level = bisect.bisect_right(self.thresholds_gpu_s, job.attained_gpu_s)
        if level and self.starvation_factor > 0:
            ran_s = job.attained_gpu_s / max(job.requested, 1)
            waited_s = max(0.0, time_s - job.submit_time_s - ran_s)
            if ran_s > 0 and waited_s >= self.starvation_factor * ran_s:
                level = 0
        return level

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        # Starvation promotion reads the clock, so every job's queue may move each call.
        if snapshot.jobs and self.starvation_factor == 0 and not (self.codesign and co.is_active(snapshot)):
            return self.ranked.schedule(snapshot, self._levels, _levels_rank, self._whole_pass)
        return self._whole_pass(snapshot)

    def _whole_pass(self, snapshot: ClusterSnapshot) -> Plan:
        jobs = snapshot.jobs
        return rigid_plan(snapshot, sorted_by(jobs, self._levels(snapshot, jobs)), codesign=self.codesign)

    def _levels(self, snapshot: ClusterSnapshot, jobs: Sequence[JobInfo]) -> np.ndarray:
        return np.array([self.queue(job, snapshot.time_s) for job in jobs], dtype=np.float64)

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """See scheduler.steady. While every job runs on its request nobody waits, and no order
        changes the plan; a fixed point holds until a running job reaches its next threshold
        (its queue is all the order reads of its service), unless starvation promotion reads
        the clock."""
        if self.codesign and co.is_active(snapshot):
            return NO_PROMISE
        if everyone_holds_requested(snapshot, plan):
            return FOREVER_DEPARTURES
        if self.starvation_factor > 0 or not unchanged(snapshot, plan):
            return NO_PROMISE
        return Steadiness(threshold_crossing(snapshot, plan, self.thresholds_gpu_s))


def _levels_rank(snapshot: ClusterSnapshot, levels: np.ndarray, runs_in_place: np.ndarray) -> np.ndarray:
    return levels  # running or not: a job's queue is all the order reads
