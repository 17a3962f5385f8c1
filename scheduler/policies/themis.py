"""Themis: finish-time fairness with a fairness knob, rigid and gang-scheduled.

Mahajan et al., "Themis: Fair and Efficient GPU Cluster Scheduling", NSDI'20. A job's
finish-time fairness is ``rho = T_shared / T_ideal``: how much longer it takes in the shared
cluster than it would on its own share; rho <= 1 is fair, larger is worse.

Definitions used here (per job; G = GPUs of the training pool, N = active jobs, C =
``snapshot.restart_cost_s``, I = ``snapshot.interval_s``):

- ``g``: predicted goodput on its requested GPUs at its own batch size, packed on the
  fewest nodes, GPU-only (:mod:`scheduler.policies.estimates`); ``r = remaining_samples /
  g'`` the remaining time, where ``g'`` is the same prediction on the job's current node
  count when it runs in place (else ``g' = g``).
- ``T_ideal = target_samples / g * max(1, requested * N / G)`` with the default
  ``ideal="fair_share"``: the job's whole running time at its requested size, stretched by
  Themis's contention model when its size exceeds its 1/N share of the cluster (time-slicing
  a ``G/N``-GPU share). ``ideal="dedicated"`` drops the stretch: the running time alone on
  the cluster, no queueing.
- ``T_shared = (time_s - submit_time_s) + c + r``, with ``c = 0`` for a job already running in
  place on its requested GPUs and ``c = C`` otherwise (it must start or restart): the finish
  time if it holds its requested GPUs from now on. ``rho = T_shared / T_ideal``.

Leases: every round is one lease of ``interval_s``; all GPUs are re-decided each round. A job
passed over now can start at the next round at the earliest, so its finish-time fairness
would be ``rho_wait = (elapsed + I + C + r) / T_ideal``. Its bid for the lease is the gain
``log(rho_wait / rho)`` (0 for a job that cannot progress), which is larger for a job already
running (no restart), for a short job and for a job early in its life.

Allocation each round (Themis's two steps, simplified for rigid gang jobs):

1. Fairness filter: the ``max(1, ceil((1 - fairness_knob) * N))`` jobs with the worst
   (largest) rho take part in the auction. ``fairness_knob = 0`` lets every job bid (most
   efficient); ``fairness_knob = 1`` only the single worst job.
2. Auction among them: Themis's partial-allocation mechanism maximises the product of the
   participants' rho improvements; with all-or-nothing gangs that is a knapsack on
   ``sum(log(rho_wait / rho))`` under the GPU capacity, solved greedily by gain per GPU.
3. Leftover GPUs go to the jobs outside the auction, worst rho first (work conservation).

Each job gets ``job.requested`` GPUs or none. Ties: larger ``priority`` first, then arrival,
then job id. The default knob 0.8 (the worst fifth of the jobs bid) leans towards fairness;
a public Themis-on-YARN prototype defaults its ``themis.fairness.knob`` to 0.2, which under
this module's reading lets 80% of the jobs bid.

Hysteresis: since every round re-decides every GPU, two jobs that cannot both run swap
whenever their rho cross: the waiting one's rho grows by about ``I / T_ideal`` a round while
the running one's barely moves, and each swap costs both a restart. ``keep_margin`` ranks a
job running in place with its rho raised by that fraction, so a challenger displaces it
only once its rho is that much worse (roughly: a job keeps its GPUs for that fraction of its
shared time, which makes the restart cost small next to the time it holds them). It is 0 by
default (the original per-round leases).

With ``codesign`` (SiloD) the plan's cache and IO come from
:func:`scheduler.codesign.co_allocate`, but rho stays GPU-only unless ``io_aware_rho``, which
prices it with ``T(g, c, b)`` (IO = the whole budget). Storage-bound jobs then have a
remaining time and an ideal time of the same storage-bound order, so the rho of two of them
stay within fractions of a percent of each other and cross every few rounds: without
hysteresis the two ImageNet jobs of workload-6 on the IO-bound cluster swapped GPUs some 520
times each (1,180 restarts in all, 382 with GPU-only rho; docs/evaluation.md). So
``io_aware_rho`` always ranks with a margin of at least ``IO_AWARE_KEEP_MARGIN``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from scheduler.policies.estimates import (
    current_nodes,
    goodput,
    in_place,
    isolated_time_s,
    pool_gpus,
    remaining_time,
    rigid_plan,
    sorted_by,
)
from scheduler import codesign as co
from scheduler.policy import ClusterSnapshot, Plan
from scheduler.registry import register
from scheduler.steady import FOREVER_DEPARTURES, NO_PROMISE, Steadiness, everyone_holds_requested

IO_AWARE_KEEP_MARGIN = 0.1  # io_aware_rho's smallest keep_margin: two ImageNet jobs restart 1 time in 20,000 s instead of 79


@dataclass(frozen=True)
class FairnessEstimate:
    """Per job (in ``snapshot.jobs`` order) what Themis ranks by; times in seconds."""

    ideal_s: np.ndarray  # T_ideal
    shared_s: np.ndarray  # T_shared if the job holds its requested GPUs from now on
    rho: np.ndarray  # finish-time fairness if served now
    rho_wait: np.ndarray  # ... if passed over for this lease
    bid: np.ndarray  # log(rho_wait / rho), 0 when the job cannot progress


@register("themis")
@dataclass(frozen=True)
class ThemisPolicy:
    fairness_knob: float = 0.8  # f in [0, 1]: the worst ceil((1 - f) N) jobs (at least one) bid in the auction
    ideal: Literal["fair_share", "dedicated"] = "fair_share"  # T_ideal contention model (see module docstring)
    codesign: bool = False  # SiloD: grant cache and IO with the GPUs (scheduler.codesign)
    io_aware_rho: bool = False  # with codesign, also price rho with T(g, c, b) (module docstring)
    keep_margin: float = 0.0  # hysteresis: a job running in place ranks with rho * (1 + keep_margin)

    def __post_init__(self):
        if not 0.0 <= self.fairness_knob <= 1.0:
            raise ValueError(f"fairness_knob must be in [0, 1], got {self.fairness_knob}")
        if self.ideal not in ("fair_share", "dedicated"):
            raise ValueError(f"ideal must be 'fair_share' or 'dedicated', got {self.ideal!r}")
        if not (self.keep_margin >= 0.0 and math.isfinite(self.keep_margin)):
            raise ValueError(f"keep_margin must be a finite number >= 0, got {self.keep_margin}")

    def estimate(self, snapshot: ClusterSnapshot) -> FairnessEstimate:
        """Finish-time fairness of every active job (the module docstring defines each term)."""
        jobs = snapshot.jobs
        n = len(jobs)
        # One prediction for both: as placed now (remaining time) and packed (the ideal).
        nodes = np.concatenate([current_nodes(snapshot, jobs), np.zeros(n, dtype=np.int64)])
        both = goodput(snapshot, jobs + jobs, nodes=nodes, codesign=self.codesign and self.io_aware_rho)
        remaining = remaining_time(jobs, both[:n])
        ideal = isolated_time_s(jobs, both[n:])
        if self.ideal == "fair_share":
            capacity = pool_gpus(snapshot)
            requested = np.array([job.requested for job in jobs], dtype=np.float64)
            share = capacity / n if n else 0.0
            ideal = ideal * (np.maximum(1.0, requested / share) if share > 0 else np.inf)
        elapsed = np.array([max(0.0, snapshot.time_s - job.submit_time_s) for job in jobs], dtype=np.float64)
        start = np.where(in_place(snapshot, jobs), 0.0, snapshot.restart_cost_s)
        shared = elapsed + start + remaining
        wait = elapsed + snapshot.interval_s + snapshot.restart_cost_s + remaining
        rho = _ratio(shared, ideal)
        rho_wait = _ratio(wait, ideal)
        with np.errstate(all="ignore"):
            bid = np.log(wait / shared)
        bid = np.where(np.isfinite(bid) & (bid > 0), bid, 0.0)
        return FairnessEstimate(ideal_s=ideal, shared_s=shared, rho=rho, rho_wait=rho_wait, bid=bid)

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        jobs = snapshot.jobs
        if not jobs:
            return Plan()
        fairness = self.estimate(snapshot)
        margin = max(self.keep_margin, IO_AWARE_KEEP_MARGIN) if self.codesign and self.io_aware_rho else self.keep_margin
        rank = np.where(in_place(snapshot, jobs), fairness.rho * (1.0 + margin), fairness.rho) if margin > 0 else fairness.rho
        by_rho = sorted_by(jobs, -rank)
        bidders = by_rho[: max(1, math.ceil((1.0 - self.fairness_knob) * len(jobs) - 1e-9))]
        position = {job.job_id: k for k, job in enumerate(jobs)}
        density = [fairness.bid[position[job.job_id]] / max(job.requested, 1) for job in bidders]
        auction = sorted_by(bidders, [-d for d in density])
        taken = {job.job_id for job in bidders}
        order = auction + [job for job in by_rho if job.job_id not in taken]
        return rigid_plan(snapshot, order, codesign=self.codesign)

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """See scheduler.steady. Every job's rho moves with the clock, so only a round in which
        every job runs on its request (nobody waits, no order matters) makes a promise."""
        if self.codesign and co.is_active(snapshot):
            return NO_PROMISE
        return FOREVER_DEPARTURES if everyone_holds_requested(snapshot, plan) else NO_PROMISE


def _ratio(time_s: np.ndarray, ideal_s: np.ndarray) -> np.ndarray:
    """``time / ideal``; inf for an ideal of 0 (nothing to do, yet it waits), 0 for an infinite ideal (cannot progress)."""
    with np.errstate(all="ignore"):
        ratio = time_s / ideal_s
    ratio = np.where(ideal_s == 0, np.inf, ratio)
    return np.where(np.isfinite(ideal_s), ratio, 0.0)
