"""Pollux: goodput-optimized elastic GPU allocation (Qiao et al., OSDI'21).

Every round each job gets a GPU count (0, or within ``[min_gpus, max_gpus]``) and a batch
size. The policy maximizes Pollux's *fitness*, the power mean of per-job speedups::

    FITNESS_p = ( 1/N * sum_j (SPEEDUP_j(A_j) + floor)^p )^(1/p)        (geometric mean for p = 0)

- ``SPEEDUP_j(A) = goodput_j(A, best batch) / goodput_j(base)``, from
  :func:`estimator.predict.predict` with ``batch_size=0`` (the goodput-optimal batch). The
  base is one GPU (the estimator's own ``speedup``, Pollux's definition) or, with
  ``speedup_base="fair_share"``, ``ceil(total GPUs / jobs)`` GPUs as in the Pollux artifact's
  simulator. A count is priced on the fewest nodes that hold it; the batch size handed out
  is recomputed on the nodes the job actually gets.
- A job given 0 GPUs has speedup 0. ``floor`` (1e-3, as in the artifact) keeps the mean
  finite, so with ``p < 0`` an unallocated job costs ``floor^p`` (1,000 at p = -1): giving a
  job its first GPUs beats nearly anything else, which is what makes p = -1 fair.
- Restart penalty: a job whose GPU count changes (including a start) makes no progress for
  ``restart_cost_s``, so its speedup under any count other than the current one is
  multiplied by a factor (:meth:`PolluxPolicy.restart_factor`): by default
  ``(H - restart_cost) / H`` with ``H = penalty_rounds x interval_s`` — the share of the
  next ``H`` seconds it keeps — or, with ``penalty_model="age"``, the artifact simulator's
  ``max(age - restarts x cost, 0) / (age + cost)``. A job keeping its count stays on its
  GPUs (:func:`scheduler.placement.place` keeps running jobs in place) and pays nothing, so
  small gains do not move jobs around. ``penalty_rounds=1`` is the literal "fraction of the
  next interval lost"; the default 2 (a new allocation usually lasts longer than one round)
  gave lower average JCT in silod's simulator on the Pollux workloads (workload-6, 60 s
  rounds, 30 s restarts: 2617 s with 1 round, 2427 s with 2, 2416 s with 4).

Search. The fitness is separable: maximizing it is maximizing ``sum_j u_j(g_j)`` with
``u(s) = -(s + floor)^p`` for ``p < 0``, ``(s + floor)^p`` for ``p > 0``, ``log(s + floor)``
for ``p = 0``, subject to ``sum_j g_j <= total GPUs``. One vectorized ``predict`` call prices
every job at every count it may get (and single-node-sized counts also spread over two
nodes); then

- ``dp`` (default when ``jobs x GPUs x counts`` is small, e.g. the 16 x 4 GPU Pollux
  cluster): an exact group-knapsack dynamic program over GPU counts (DeepBoot's ATS-T
  method, here with Pollux's objective), over only the counts a Lagrangian bound cannot rule
  out (usually a handful per job) when that leaves few;
- ``greedy`` (large clusters): the multiple-choice-knapsack greedy on each job's upper
  concave hull of ``u_j`` (take hull segments in decreasing order of gain per GPU while they
  fit; its fractional relaxation is optimal, the integral result is at most one segment
  away), then local search: fill spare GPUs and move GPUs from the job that loses least to
  the job that gains most while the sum improves.

Ties (identical jobs) go to the job with the least attained service, then the earliest.

Placement: :func:`scheduler.placement.place`, jobs that need new GPUs ordered single-node
jobs first, largest first (best-fit decreasing), then multi-node jobs (in the Pollux model
a job spanning nodes syncs equally slowly over 2 or 10 nodes, so they lose nothing by
filling the leftovers). Counts alone do not guarantee that a 3-GPU job finds 3 free GPUs on
one node; when a single-node-sized job had to be spread, its count is re-priced as spread
and the search re-run (``repack_rounds`` times); the plan with the best fitness *as placed*
wins. Inference-pool GPUs are not used. Interference avoidance (no two distributed jobs
sharing a node) is not implemented.

Cache and remote IO: GPU-only by default (IO not limiting in every prediction). With
``codesign`` (SiloD) and data resources in the snapshot, every candidate is priced with the
estimator's ``T(g, c, b)`` at the job's expected cache (:func:`scheduler.codesign.expected_grants`)
and its max-min fair share of the storage budget (demands at the requested GPUs), so an
IO-bound job is not given GPUs it cannot feed and gets a batch size for its IO; the plan's
cache and IO then come from :func:`scheduler.codesign.co_allocate`, IO to the jobs with the
fewest remote bytes left first (``codesign_io="srpt"``, as for every other policy) or
max-min fair (``"max_min"``, the share the speedups assumed). On the storage-bound Philly
scenario (docs/evaluation.md) max-min fair IO finished all eleven LibriSpeech jobs together,
processor sharing on the storage: 38,601 s average JCT against 25,326 s with srpt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from scheduler import codesign as co
from scheduler.placement import blind_preferences, largest_type_gpus, node_types, place, placement_type
from scheduler.policies.pollux_counts import local_search, solve_counts, solve_dp
from scheduler.policies.pollux_estimates import (JobTable, best_batch_sizes, gpus_per_node, held_in_place, packed_goodput,
                                                 pool_nodes)
from scheduler.policies.pollux_speedups import SpeedupTable, candidate_grants, remembered_speedups, with_model
from scheduler.policies.typed_counts import assign_types, best_start
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register
from scheduler.steady import NO_PROMISE, Steadiness, attained_order_change, unchanged

# Tie-break bonus (utility units) for being allocated, spread over the jobs' ranks. Utility
# differences that matter are >= 1e-3 or so (speedups of order 1); this only orders equals.
_TIE_BREAK = 1e-6


def power_mean(speedups, p: float, floor: float = 1e-3) -> float:
    """Pollux's fitness of a vector of speedups (0 for jobs without GPUs)."""
    s = np.asarray(speedups, dtype=np.float64) + floor
    if s.size == 0:
        return 0.0
    if p == 0:
        return float(np.exp(np.mean(np.log(s))))
    return float(np.mean(s**p) ** (1.0 / p))


@register("pollux")
@dataclass(frozen=True)
class PolluxPolicy:
    p: float = -1.0                         # power-mean exponent; more negative = fairer, 1 = total speedup
    restart_penalty: bool = True            # discount speedups of count changes by the time a restart loses
    penalty_model: Literal["interval", "age"] = "interval"  # see restart_factor
    penalty_rounds: float = 2.0             # "interval": the restart cost is spread over this many rounds
    max_gpus_per_job: int = 64              # cap on any job's count (never below its min_gpus)
    speedup_base: Literal["one_gpu", "fair_share"] = "one_gpu"
    floor: float = 1e-3                     # added to every speedup in the power mean
    solver: Literal["auto", "dp", "greedy"] = "auto"
    dp_limit: int = 5_000_000               # auto: DP when jobs x (GPUs + 1) x (max count + 1) is at most this
    local_search_moves: int = 200           # greedy: at most this many improving moves
    repack_rounds: int = 3                  # re-solve when single-node-sized jobs had to be split (see schedule)
    codesign: bool = False                  # SiloD: price with T(g, c, b), grant cache and IO (scheduler.codesign)
    codesign_io: Literal["max_min", "srpt"] = "srpt"  # how co_allocate grants IO (see the module docstring)
    heterogeneity_aware: bool = True        # False: one pool priced at the reference type, types chosen blind

    def __post_init__(self):
        if not math.isfinite(self.p):
            raise ValueError("p must be finite")
        if self.max_gpus_per_job < 1:
            raise ValueError("max_gpus_per_job must be at least 1")
        if self.speedup_base not in ("one_gpu", "fair_share"):
            raise ValueError(f"speedup_base must be 'one_gpu' or 'fair_share', got {self.speedup_base!r}")
        if self.solver not in ("auto", "dp", "greedy"):
            raise ValueError(f"solver must be 'auto', 'dp' or 'greedy', got {self.solver!r}")
        if not self.floor > 0:
            raise ValueError("floor must be positive")
        if self.penalty_model not in ("interval", "age"):
            raise ValueError(f"penalty_model must be 'interval' or 'age', got {self.penalty_model!r}")
        if not self.penalty_rounds > 0:
            raise ValueError("penalty_rounds must be positive")
        if self.codesign_io not in ("max_min", "srpt"):
            raise ValueError(f"codesign_io must be 'max_min' or 'srpt', got {self.codesign_io!r}")

    # -- the objective -------------------------------------------------------------------

    def utility(self, speedup: np.ndarray) -> np.ndarray:
        """Each job's term of the separable objective (increasing in the speedup)."""
        s = np.asarray(speedup, dtype=np.float64) + self.floor
        if self.p == 0:
            return np.log(s)
        return np.sign(self.p) * s**self.p

    def restart_factor(self, snapshot: ClusterSnapshot, jobs=None) -> np.ndarray:
        """Per job: share of its speedup kept when its GPU count changes (1 without the penalty).

        ``"interval"``: ``(H - cost) / H`` — the restart cost out of the next ``H =
        penalty_rounds x interval_s`` seconds. ``"age"`` (the Pollux artifact simulator): ``max(age - restarts x
        cost, 0) / (age + cost)``, the share of the job's life so far not lost to restarts
        once one more is paid — old jobs that rarely restarted move almost freely.
        """
        jobs = snapshot.jobs if jobs is None else jobs
        if not self.restart_penalty:
            return np.ones(len(jobs))
        cost = snapshot.restart_cost_s
        if self.penalty_model == "age":
            age = np.array([max(snapshot.time_s - job.submit_time_s, 0.0) for job in jobs])
            restarts = np.array([job.restarts for job in jobs], dtype=np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                factor = np.where(age + cost > 0, np.maximum(age - restarts * cost, 0.0) / (age + cost), 1.0)
            return factor
        horizon = self.penalty_rounds * snapshot.interval_s
        if horizon <= 0:
            return np.ones(len(jobs))
        return np.full(len(jobs), max(0.0, (horizon - cost) / horizon))

    def speedup_table(self, snapshot: ClusterSnapshot) -> SpeedupTable:
        """Price every job at every GPU count it may get (one vectorized estimator call)."""
        jobs = snapshot.jobs
        n = len(jobs)
        capacity = sum(node.gpus for node in pool_nodes(snapshot))
        per_node = gpus_per_node(snapshot)
        low = np.array([job.min_gpus for job in jobs], dtype=np.int64)
        high = np.array(
            [min(max(min(job.max_gpus, self.max_gpus_per_job), job.min_gpus), capacity) for job in jobs], dtype=np.int64
        )
        high = np.where(high >= low, high, 0)  # a job whose minimum exceeds the cluster gets nothing
        width = int(high.max(initial=0)) + 1
        current = held_in_place(snapshot, jobs)
        current_nodes = np.array([len(a.placement) if (a := snapshot.current.get(job.job_id)) else 0 for job in jobs])
        factor = self.restart_factor(snapshot)

        speedup = np.full((n, width), np.nan)
        speedup[:, 0] = 0.0
        split = np.full((n, width), np.nan)
        raw, raw_split = speedup.copy(), split.copy()
        estimates = JobTable(jobs)
        sizes = np.where(high > 0, high - low + 1, 0)
        if sizes.sum():
            # Candidates: every allowed count packed, plus single-node-sized counts split over 2 nodes.
            rows = np.repeat(np.arange(n), sizes)
            counts = np.arange(rows.size) - np.repeat(np.cumsum(sizes) - sizes, sizes) + low[rows]
            spread = (counts >= 2) & (counts <= per_node)
            all_rows = np.concatenate([rows, rows[spread]])
            all_counts = np.concatenate([counts, counts[spread]])
            nodes = np.concatenate([np.zeros(rows.size, dtype=np.int64), np.full(int(spread.sum()), 2)])
            cache, io = candidate_grants(self.codesign, snapshot, all_rows, all_counts)
            if self.speedup_base == "one_gpu" and not (self.codesign and co.is_active(snapshot)):
                # Only the job's model, count range and node size matter: remembered across rounds.
                values = remembered_speedups(estimates, jobs, low, high, sizes, rows, spread, nodes, per_node)
            elif self.speedup_base == "one_gpu":
                values = estimates.predict(all_rows, all_counts, nodes, per_node=per_node, cache_bytes=cache,
                                           remote_io_bytes_per_s=io).speedup
            else:
                pred = estimates.predict(all_rows, all_counts, nodes, per_node=per_node, cache_bytes=cache,
                                         remote_io_bytes_per_s=io)
                fair = np.clip(-(-capacity // max(n, 1)), low, np.maximum(high, 1))
                base = np.zeros(n)
                at_base = (counts == fair[rows])
                base[rows[at_base]] = pred.goodput_samples_per_s[: rows.size][at_base]
                with np.errstate(divide="ignore", invalid="ignore"):
                    values = np.where(base[all_rows] > 0, pred.goodput_samples_per_s / base[all_rows], 0.0)
            stays = (all_counts == current[all_rows]) & (
                (nodes == 0) & ((current_nodes[all_rows] == 1) | (all_counts > per_node))
                | (nodes == 2) & (current_nodes[all_rows] > 1)
            )
            raw[rows, counts] = values[: rows.size]
            raw_split[rows[spread], counts[spread]] = values[rows.size:]
            values = np.where(stays, values, values * factor[all_rows])
            speedup[rows, counts] = values[: rows.size]
            split[rows[spread], counts[spread]] = values[rows.size:]
            # Keeping a split placement is worth what the split placement gives.
            keep_split = (current > 0) & (current <= per_node) & (current_nodes > 1) & (current >= low) & (current <= high)
            speedup[keep_split, current[keep_split]] = split[keep_split, current[keep_split]]
        # Order among equals: least attained service, then arrival.
        rank = np.empty(n)
        rank[sorted(range(n), key=lambda i: (jobs[i].attained_gpu_s, jobs[i].submit_time_s, jobs[i].job_id))] = np.arange(n)
        tie_break = _TIE_BREAK * (1.0 - rank / max(n, 1))
        utility = np.where(np.isnan(speedup), -np.inf, self.utility(np.nan_to_num(speedup)))
        utility[:, 1:] += tie_break[:, None]
        return SpeedupTable(
            tuple(jobs), capacity, per_node, current, speedup, split, raw, raw_split, utility, factor, tie_break, estimates
        )

    def placed_speedups(self, table: SpeedupTable, snapshot: ClusterSnapshot, placements) -> np.ndarray:
        """Per job: its (penalized) speedup under ``placements`` — on the nodes it actually gets."""
        result = np.zeros(len(table.jobs))
        current = snapshot.current.allocations
        for j, job in enumerate(table.jobs):
            placement = placements.get(job.job_id)
            if not placement:
                continue
            gpus = sum(len(ix) for _, ix in placement)
            raw = table.raw_split[j, gpus] if len(placement) > 1 and gpus <= table.per_node else table.raw[j, gpus]
            held = current.get(job.job_id)
            result[j] = raw if held is not None and held.placement == placement else raw * table.factor[j]
        return result

    def fitness(self, table: SpeedupTable, counts) -> float:
        """Power mean of the (restart-penalized) speedups under ``counts``."""
        counts = np.asarray(counts, dtype=np.int64)
        return power_mean(table.speedup[np.arange(len(counts)), counts], self.p, self.floor)

    # -- the search ----------------------------------------------------------------------

    def choose_counts(self, table: SpeedupTable, utility: np.ndarray | None = None, start: np.ndarray | None = None) -> np.ndarray:
        """GPU count per job maximizing the fitness (see the module docstring).

        ``utility`` replaces the table's (re-priced entries); ``start``, a previous answer,
        lets the greedy solver go straight to local search from it.
        """
        utility = table.utility if utility is None else utility
        n, width = utility.shape
        if n == 0 or table.capacity == 0 or width == 1:
            return np.zeros(n, dtype=np.int64)
        if start is None:
            return self._solve_capacity(utility, table.capacity)
        solver = self.solver
        if solver == "auto":
            solver = "dp" if n * (table.capacity + 1) * width <= self.dp_limit else "greedy"
        if solver == "dp":
            return solve_dp(utility, table.capacity)
        return local_search(utility, table.capacity, start, self.local_search_moves)

    # -- the policy ----------------------------------------------------------------------

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if not snapshot.jobs:
            return Plan({})
        if len(snapshot.gpu_types()) > 1:
            if self.heterogeneity_aware:
                return self._schedule_typed(snapshot)
            # Type-blind, but a job still runs on one type: no count above the largest type's GPUs.
            widest = largest_type_gpus(snapshot)
            if widest < self.max_gpus_per_job:
                return dataclasses.replace(self, max_gpus_per_job=widest).schedule(snapshot)
        table = self.speedup_table(snapshot)
        utility = table.utility
        best_value, best, counts = -np.inf, None, None
        for attempt in range(1 + self.repack_rounds):
            counts = self.choose_counts(table, utility, counts)
            placements = self._place(snapshot, table, counts)
            speedups = self.placed_speedups(table, snapshot, placements)
            value = float(np.sum(self.utility(speedups) + np.where(speedups > 0, table.tie_break, 0.0)))
            if value > best_value:
                best_value, best = value, placements
            # Jobs that fit on one node but did not get one: price that count as split and retry.
            split = [
                (j, int(c)) for j, (job, c) in enumerate(zip(table.jobs, counts))
                if 1 < c <= table.per_node and len(placements.get(job.job_id, ())) > 1
            ]
            if not split:
                break
            utility = utility.copy()
            for j, c in split:
                utility[j, c] = self.utility(table.split[j, c]) + table.tie_break[j]
        if not best:
            return Plan({})
        return self._plan(snapshot, best, table.per_node, table.estimates)

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """See scheduler.steady. With the interval restart penalty (the default) the search reads
        no clock and no progress, only the order of attained service (it breaks ties between
        equal jobs): its own plan shown back to it is kept until a job arrives or leaves, or
        that order changes. The age penalty reads the clock; co-design reads caches."""
        if (self.penalty_model != "interval" and self.restart_penalty) or (self.codesign and co.is_active(snapshot)):
            return NO_PROMISE
        if not unchanged(snapshot, plan):
            return NO_PROMISE
        return Steadiness(attained_order_change(snapshot, plan))

    # -- several GPU types --------------------------------------------------------------

    def type_table(self, snapshot: ClusterSnapshot, gpu_type: str) -> SpeedupTable:
        """:meth:`speedup_table` of the training nodes of ``gpu_type``, every job priced with its
        model on that type and its speedup over one GPU of the reference type (so speedups on
        different types compare); -inf utility on a type the job does not allow."""
        nodes = tuple(n for n in snapshot.nodes if n.pool != "training" or n.gpu_type == gpu_type)
        jobs = tuple(with_model(job, job.model_on(gpu_type)) for job in snapshot.jobs)
        table = self.speedup_table(dataclasses.replace(snapshot, nodes=nodes, jobs=jobs))
        ratio = base_goodput_ratio(snapshot.jobs, gpu_type) if self.speedup_base == "one_gpu" else np.ones(len(jobs))
        scale = ratio[:, None]
        speedup, split = table.speedup * scale, table.split * scale
        utility = np.where(np.isnan(speedup), -np.inf, self.utility(np.nan_to_num(speedup)))
        utility[:, 1:] += table.tie_break[:, None]
        banned = np.array([not job.allows(gpu_type) for job in snapshot.jobs])
        utility[banned, 1:] = -np.inf
        return dataclasses.replace(table, jobs=tuple(snapshot.jobs), speedup=speedup, split=split, raw=table.raw * scale,
                                   raw_split=table.raw_split * scale, utility=utility)

    def _schedule_typed(self, snapshot: ClusterSnapshot) -> Plan:
        """Type and count per job (:func:`scheduler.policies.typed_counts.assign_types`), then placement on that type."""
        types = snapshot.gpu_types()
        tables = [self.type_table(snapshot, t) for t in types]
        kinds = node_types(snapshot)
        current = np.array([_current_type(snapshot, job, kinds, types) for job in snapshot.jobs], dtype=np.int64)
        requested = np.array([job.requested for job in snapshot.jobs], dtype=np.int64)
        utilities = [t.utility for t in tables]
        assign, counts = assign_types(utilities, [t.capacity for t in tables],
                                      lambda u, cap: self._solve_capacity(u, cap), best_start(utilities, requested, current))
        wanted = {job.job_id: int(c) for job, c in zip(snapshot.jobs, counts) if c > 0}
        preferences = {job.job_id: (types[a],) for job, a in zip(snapshot.jobs, assign)}
        order = sorted(wanted, key=lambda job_id: (wanted[job_id] > tables[0].per_node, -wanted[job_id]))
        placements = place(snapshot, wanted, order, preferences=preferences).placements
        if not placements:
            return Plan({})
        return self._plan(snapshot, placements, tables[0].per_node)

    def _plan(self, snapshot: ClusterSnapshot, placements, per_node: int, estimates: JobTable | None = None) -> Plan:
        """Each placed job's batch size on the GPUs and nodes it got and, with co-design, its
        cache and IO. ``estimates``: the untyped table, whose rows are the snapshot's jobs; None
        on several types, where each job is priced on the type it got."""
        placed = list(placements)
        index = {job.job_id: i for i, job in enumerate(snapshot.jobs)}
        rows = np.array([index[job_id] for job_id in placed])
        gpus = np.array([sum(len(ix) for _, ix in placements[job_id]) for job_id in placed])
        nodes = np.array([len(placements[job_id]) for job_id in placed])
        kinds = node_types(snapshot) if estimates is None else {}
        on = [placement_type(placements[job_id], kinds, snapshot.jobs[index[job_id]]) for job_id in placed]
        codesign = self.codesign and co.is_active(snapshot)
        if codesign:
            cache, io = candidate_grants(self.codesign, snapshot, rows, gpus)
            if estimates is None:
                estimates, rows = JobTable([snapshot.jobs[r] for r in rows], gpu_types=on), np.arange(len(placed))
            batch = estimates.predict(rows, gpus, nodes, per_node=per_node, cache_bytes=cache,
                                      remote_io_bytes_per_s=io).batch_size
        else:  # no cache, IO not limiting: the batch each count and spread gives, remembered across rounds
            batch = best_batch_sizes([snapshot.jobs[r].model_on(t) for r, t in zip(rows, on)], gpus, nodes,
                                     per_node=per_node)
        if codesign:
            return co.co_allocate(snapshot, placements, placed, {j: int(b) for j, b in zip(placed, batch)}, io=self.codesign_io)
        return Plan({job_id: Allocation(placement=placements[job_id], batch_size=int(b), gpu_type=t)
                     for job_id, b, t in zip(placed, batch, on)})

    def _solve_capacity(self, utility: np.ndarray, capacity: int) -> np.ndarray:
        return solve_counts(utility, capacity, self.solver, self.dp_limit, self.local_search_moves)

    def _place(self, snapshot: ClusterSnapshot, table: SpeedupTable, counts: np.ndarray):
        wanted = {job.job_id: int(c) for job, c in zip(table.jobs, counts) if c > 0}
        # Jobs that need new GPUs (those keeping theirs are placed first anyway): jobs that fit
        # on one node first, largest first (best-fit decreasing keeps them on one node), then
        # multi-node jobs, which lose nothing more by filling whatever GPUs are left.
        order = sorted(wanted, key=lambda job_id: (wanted[job_id] > table.per_node, -wanted[job_id]))
        blind = None if self.heterogeneity_aware else blind_preferences(snapshot, wanted)
        return place(snapshot, wanted, order, preferences=blind).placements


def base_goodput_ratio(jobs, gpu_type: str) -> np.ndarray:
    """Per job: its goodput on one GPU of ``gpu_type`` over one GPU of its reference model (best batches)."""
    on_type = packed_goodput([job.model_on(gpu_type) for job in jobs], 1, 0, per_node=1)
    base = packed_goodput([job.model for job in jobs], 1, 0, per_node=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(base > 0, on_type / np.where(base > 0, base, 1.0), 1.0)


def _current_type(snapshot: ClusterSnapshot, job: JobInfo, kinds, types) -> int:
    """Index in ``types`` of the one type the job runs on now, else -1."""
    allocation = snapshot.current.get(job.job_id)
    if allocation is None or not allocation.placement:
        return -1
    held = {kinds.get(node) for node, _ in allocation.placement}
    if len(held) != 1 or next(iter(held)) not in types:
        return -1
    return types.index(next(iter(held)))
