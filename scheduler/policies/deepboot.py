"""DeepBoot ATS-T: elastic training on the training pool plus lent inference GPUs (Chen et al., TPDS'23).

Every round each training job gets a GPU count (0, or within ``[min_gpus, max_gpus]``) that
maximizes Pollux's power mean of the per-job penalized speedups::

    maximize  ( 1/N sum_j (SPEEDUP_j(g_j) x kept_j(g_j) + floor)^p )^(1/p)     subject to  sum_j g_j <= capacity

DeepBoot's own objective is the *sum* of speedups, ``p = 1`` (kept literally: no floor).
The default is ``p = -1`` (Pollux's default): measured on the DeepBoot mixed workload
(docs/evaluation.md, "DeepBoot"; seed 1, no resize penalty) it cuts average training JCT
from 4,998 s to 2,869 s: with 160 jobs on ~40 GPUs the sum of speedups keeps GPUs on the jobs
with the best marginal speedup while others wait; p = -1 gives every job its first GPUs first.

- ``SPEEDUP_j(g)``: goodput at the best batch on ``g`` GPUs packed on the fewest nodes, over
  goodput on one GPU — the Pollux goodput model through
  :class:`scheduler.policies.pollux_estimates.JobTable`, the same estimate the ``pollux``
  policy uses.
- ``kept_j(g)``: 1 when ``g`` is the count the job holds in place now (it stays where it
  is); otherwise the share of the next ``penalty_rounds x interval_s`` seconds left after
  the job's resize cost (:mod:`scheduler.deepboot.costs`: a full restart of 18-103 s per
  application when it holds nothing or without AFE, an AFE resize of 1-5 s when it does)
  plus, for a job that holds GPUs, ``resize_penalty_rounds x interval_s`` (default 0.5 rounds:
  30 s at the simulator's 60 s rounds, 5 s at the live scheduler's 10 s). AFE makes a resize
  nearly free (3 s of a 120 s horizon keeps 97.5 %), and priced at that the objective moved
  GPUs for any marginal gain; the fixed penalty is hysteresis: it halves the resizes
  (1,644 -> 807 on the workload above) and the jobs still pay only the AFE seconds.
- ``capacity``: training-pool GPUs plus the inference-pool GPUs no RUNNING or PROTECT replica
  holds (``ClusterSnapshot.inference_busy``; :mod:`scheduler.deepboot.lending`).

The power mean is an increasing function of ``sum_j u(s_j)`` with ``u(s) = sign(p) (s + floor)^p``
(``log(s + floor)`` for p = 0), the transformation ``pollux`` uses, so the objective stays a
sum of per-job terms and the group knapsack below is exact for every p: the DP takes the
best of every (job, count) entry and needs no concavity. With ``p = -1`` and ``afe=False`` this
is Pollux's goodput objective (its restart penalty priced with DeepBoot's per-model restart
times) run over the lendable GPUs: the "Pollux with lending" baseline of docs/evaluation.md.

The search is exact: a group knapsack over GPU counts, dynamic programming over jobs x GPUs
(:func:`scheduler.policies.pollux_counts.solve_dp`, shared with ``pollux``). Only when ``jobs x (GPUs + 1) x (largest
count + 1)`` exceeds ``dp_limit`` (thousands of jobs on thousands of GPUs) does ``solver="auto"``
fall back to ``pollux``'s concave-hull greedy with local search. Placement keeps jobs where they run, then
tries the training pool, and only then lent GPUs; busy inference GPUs are never used.
Counts are priced packed; a job that had to be spread over nodes simply runs slower (no
re-pricing round as in ``pollux``). Ties go to the job with the least attained service.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from scheduler.deepboot.ats_i import InferenceRound, place_inference_tasks
from scheduler.deepboot.costs import ResizeCosts, kept_share
from scheduler.deepboot.lending import BOTH_POOLS, held_lendable, place_lending, training_capacity
from scheduler.deepboot.state import ReplicaView
from scheduler.placement import TypeRoom, blind_preferences, largest_type_gpus, node_types, placement_type
from scheduler.policies.pollux import _current_type, base_goodput_ratio
from scheduler.policies.pollux_speedups import remembered_speedups, with_model
from scheduler.policies.pollux_counts import solve_counts
from scheduler.policies.typed_counts import assign_types, best_start
from scheduler.policies.pollux_estimates import JobTable, best_batch_sizes, gpus_per_node, held_in_place
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register
from scheduler.steady import NO_PROMISE, Steadiness, attained_order_change, unchanged

# Utility bonus for being allocated, spread over the jobs' ranks: only orders equal jobs
# (speedup differences that matter are >= 1e-3).
_TIE_BREAK = 1e-6


@dataclass(frozen=True)
class CountTable:
    """Per job (snapshot order) and GPU count: the penalized speedup, -inf where the count is not allowed."""

    jobs: tuple[JobInfo, ...]
    capacity: int                 # GPUs ATS-T may hand out
    per_node: int                 # GPUs of the largest usable node ("packed")
    held: np.ndarray              # GPUs each job holds where it may stay
    utility: np.ndarray           # (jobs, width): transformed penalized speedup + tie-break, -inf = not allowed
    estimates: JobTable


@register("deepboot")
@dataclass(frozen=True)
class DeepBootPolicy:
    afe: bool = True                                  # resizes take the AFE fast path (seconds, not a restart)
    p: float = -1.0                                   # power-mean exponent (Pollux's): 1 = DeepBoot's sum of speedups, -1 = fairer
    floor: float = 1e-3                               # added to every speedup in the power mean (as in pollux)
    resize_penalty_rounds: float = 0.5                # x interval_s, priced on top of a running job's resize cost (against churn)
    full_restart_s: Mapping[str, float] = field(default_factory=dict)  # job id / application -> s (overrides)
    afe_resize_s: Mapping[str, float] = field(default_factory=dict)    # job id / application -> s (overrides)
    penalty_rounds: float = 2.0                       # the resize cost is spread over this many rounds
    lend: bool = True                                 # False: training pool only (the no-lending baseline)
    max_gpus_per_job: int = 64
    solver: str = "auto"                              # "dp" (exact), "greedy", or "auto": dp within dp_limit
    dp_limit: int = 5_000_000
    local_search_moves: int = 200                     # greedy: at most this many improving moves
    heterogeneity_aware: bool = True                  # False: one pool at the reference speed, types chosen blind

    def __post_init__(self):
        if self.solver not in ("auto", "dp", "greedy"):
            raise ValueError(f"solver must be 'auto', 'dp' or 'greedy', got {self.solver!r}")
        if not (math.isfinite(self.penalty_rounds) and self.penalty_rounds > 0):
            raise ValueError("penalty_rounds must be a positive number")
        if self.max_gpus_per_job < 1:
            raise ValueError("max_gpus_per_job must be at least 1")
        if not math.isfinite(self.p):
            raise ValueError("p must be finite")
        if not self.floor > 0:
            raise ValueError("floor must be positive")
        if not (math.isfinite(self.resize_penalty_rounds) and self.resize_penalty_rounds >= 0):
            raise ValueError("resize_penalty_rounds must be a number >= 0")
        ResizeCosts(self.afe, self.full_restart_s, self.afe_resize_s)  # validates the overrides

    @property
    def costs(self) -> ResizeCosts:
        return ResizeCosts(self.afe, self.full_restart_s, self.afe_resize_s)

    def kept(self, snapshot: ClusterSnapshot, job: JobInfo, held: int) -> float:
        """Share of its speedup ``job`` keeps when its placement changes (it holds ``held`` GPUs in place).

        A running job's resize is priced at its cost plus ``resize_penalty_rounds x interval_s``
        (in rounds, so that it keeps its share of the ``penalty_rounds`` horizon at any round
        length; in seconds it would swamp a 10 s round's 20 s horizon): with AFE a resize
        costs 1-5 s, so without it the objective would move GPUs for any marginal gain.
        """
        starting = held == 0
        cost = self.costs.cost_s(job, starting=starting, default_s=snapshot.restart_cost_s)
        if not starting:
            cost += self.resize_penalty_rounds * snapshot.interval_s
        return kept_share(cost, self.penalty_rounds * snapshot.interval_s, starting=starting)

    def utility(self, speedup: np.ndarray) -> np.ndarray:
        """Each job's term of the separable objective: Pollux's power-mean transform of the speedup.

        ``sign(p) x (s + floor)^p`` (``log(s + floor)`` for p = 0) is increasing in ``s``, and the
        power mean ``(1/N sum (s_j + floor)^p)^(1/p)`` is an increasing function of the sum of
        these terms for every p, so maximizing the sum maximizes the fitness. The sum stays
        separable over jobs, hence the group knapsack below is still exact for any p (the DP
        needs no concavity; only the greedy fallback works on concave hulls). p = 1 is
        DeepBoot's sum of speedups, kept literal (the floor would only shift every term by the
        same constant).
        """
        if self.p == 1:
            return np.asarray(speedup, dtype=np.float64)
        s = np.asarray(speedup, dtype=np.float64) + self.floor
        if self.p == 0:
            return np.log(s)
        return np.sign(self.p) * s**self.p

    def count_table(self, snapshot: ClusterSnapshot, speedup_scale: np.ndarray | None = None) -> CountTable:
        """Price every job at every count it may get (one vectorized estimator call).

        ``speedup_scale`` (per job) multiplies the speedups: on a typed cluster, the job's
        one-GPU goodput on the type over one GPU of its reference model, so types compare.
        """
        jobs = snapshot.jobs
        n = len(jobs)
        pools = BOTH_POOLS if self.lend else ("training",)
        capacity = training_capacity(snapshot, lend=self.lend)
        per_node = gpus_per_node(snapshot, pools)
        held = held_lendable(snapshot, jobs) if self.lend else held_in_place(snapshot, jobs)
        low = np.array([job.min_gpus for job in jobs], dtype=np.int64)
        high = np.array([min(job.max_gpus, max(self.max_gpus_per_job, job.min_gpus), capacity) for job in jobs], dtype=np.int64)
        high = np.where(high >= low, high, 0)  # a minimum above the capacity: nothing allowed
        width = int(high.max(initial=0)) + 1
        utility = np.full((n, width), -np.inf)
        utility[:, 0] = self.utility(0.0)
        estimates = JobTable(jobs)
        sizes = np.where(high > 0, high - low + 1, 0)
        if sizes.sum():
            rows = np.repeat(np.arange(n), sizes)
            counts = np.arange(rows.size) - np.repeat(np.cumsum(sizes) - sizes, sizes) + low[rows]
            # A job's row depends on its model, count range and node size only: remembered across rounds.
            speedup = remembered_speedups(estimates, jobs, low, high, sizes, rows, None, None, per_node)
            if speedup_scale is not None:
                speedup = speedup * speedup_scale[rows]
            kept = np.array([self.kept(snapshot, job, int(h)) for job, h in zip(jobs, held)])
            utility[rows, counts] = self.utility(np.where(counts == held[rows], speedup, speedup * kept[rows]))
        rank = np.empty(n)
        rank[sorted(range(n), key=lambda i: (jobs[i].attained_gpu_s, jobs[i].submit_time_s, jobs[i].job_id))] = np.arange(n)
        utility[:, 1:] += (_TIE_BREAK * (1.0 - rank / max(n, 1)))[:, None]
        return CountTable(tuple(jobs), capacity, per_node, held, utility, estimates)

    def choose_counts(self, table: CountTable) -> np.ndarray:
        """GPU count per job maximizing the summed utilities, i.e. the power mean (exact group knapsack unless too large)."""
        return self._solve(table.utility, table.capacity)

    def place_inference(self, snapshot: ClusterSnapshot, applications: Sequence[str], replicas: Sequence[ReplicaView]) -> InferenceRound:
        """ATS-I for pending tasks (their applications, in queue order), pricing reclaims with this policy's costs."""
        return place_inference_tasks(snapshot, applications, replicas, costs=self.costs, penalty_rounds=self.penalty_rounds)

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if not snapshot.jobs:
            return Plan({})
        pools = BOTH_POOLS if self.lend else ("training",)
        types = snapshot.gpu_types(pools)
        if len(types) > 1 and self.heterogeneity_aware:
            tables = [self.type_table(snapshot, t) for t in types]
            kinds = node_types(snapshot)
            current = np.array([_current_type(snapshot, job, kinds, types) for job in snapshot.jobs], dtype=np.int64)
            requested = np.array([job.requested for job in snapshot.jobs], dtype=np.int64)
            utilities = [t.utility for t in tables]
            assign, counts = assign_types(utilities, [t.capacity for t in tables], self._solve,
                                          best_start(utilities, requested, current))
            chosen = {job.job_id: types[a] for job, a in zip(snapshot.jobs, assign)}
            table = dataclasses.replace(tables[0], per_node=max(t.per_node for t in tables))
        else:
            widest = largest_type_gpus(snapshot, pools)
            if len(types) > 1 and widest < self.max_gpus_per_job:  # type-blind, but one type per job
                return dataclasses.replace(self, max_gpus_per_job=widest).schedule(snapshot)
            table = self.count_table(snapshot)
            counts = self.choose_counts(table)
            chosen = None
            if len(types) > 1:  # type-blind: each job on the first type with room in a speed-blind order
                blind = blind_preferences(snapshot, [job.job_id for job in snapshot.jobs], pools)
                room = TypeRoom(snapshot, pools)
                chosen = {}
                for job, count in zip(snapshot.jobs, counts):
                    gpu_type = room.claim(int(count), blind[job.job_id]) if count > 0 else None
                    if gpu_type is not None:
                        chosen[job.job_id] = gpu_type
        wanted = {job.job_id: int(c) for job, c in zip(table.jobs, counts) if c > 0}
        # New placements: jobs that fit on one node first, largest first (best-fit decreasing).
        order = sorted(wanted, key=lambda job_id: (wanted[job_id] > table.per_node, -wanted[job_id]))
        placements = place_lending(snapshot, wanted, order, lend=self.lend, types=chosen).placements
        if not placements:
            return Plan({})
        index = {job.job_id: k for k, job in enumerate(snapshot.jobs)}
        placed = list(placements)
        kinds = node_types(snapshot)
        on = [placement_type(placements[job_id], kinds, snapshot.jobs[index[job_id]]) for job_id in placed]
        gpus = np.array([sum(len(ix) for _, ix in placements[job_id]) for job_id in placed])
        nodes = np.array([len(placements[job_id]) for job_id in placed])
        # The batch each job's count and spread gives on its type, remembered across rounds.
        batch = best_batch_sizes([snapshot.jobs[index[job_id]].model_on(t) for job_id, t in zip(placed, on)], gpus, nodes,
                                 per_node=table.per_node)
        return Plan({job_id: Allocation(placement=placements[job_id], batch_size=int(b), gpu_type=t)
                     for job_id, b, t in zip(placed, batch, on)})

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """See scheduler.steady. ATS-T reads no clock and no progress, only the order of attained
        service (it breaks ties between equal jobs) and which inference GPUs are busy (the
        snapshot's, which a promise does not cover): its own plan shown back to it is kept
        until a job arrives or leaves, or that order changes."""
        if not unchanged(snapshot, plan):
            return NO_PROMISE
        return Steadiness(attained_order_change(snapshot, plan))

    def type_table(self, snapshot: ClusterSnapshot, gpu_type: str) -> CountTable:
        """:meth:`count_table` over the nodes of ``gpu_type`` (both pools: a lent GPU is worth
        its type's speed), every job priced with its model there, speedups over one GPU of
        its reference model; -inf on a type the job does not allow."""
        nodes = tuple(n for n in snapshot.nodes if n.gpu_type == gpu_type)
        jobs = tuple(with_model(job, job.model_on(gpu_type)) for job in snapshot.jobs)
        table = self.count_table(dataclasses.replace(snapshot, nodes=nodes, jobs=jobs),
                                 speedup_scale=base_goodput_ratio(snapshot.jobs, gpu_type))
        banned = np.array([not job.allows(gpu_type) for job in snapshot.jobs])
        utility = table.utility.copy()
        utility[banned, 1:] = -np.inf
        return dataclasses.replace(table, jobs=tuple(snapshot.jobs), utility=utility)

    def _solve(self, utility: np.ndarray, capacity: int) -> np.ndarray:
        return solve_counts(utility, capacity, self.solver, self.dp_limit, self.local_search_moves)

