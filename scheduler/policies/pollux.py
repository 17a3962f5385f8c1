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
from scheduler.policies.estimates import io_demand
from scheduler.policies.pollux_estimates import (JobTable, best_batch_sizes, gpus_per_node, held_in_place, packed_goodput,
                                                 pool_nodes)
from scheduler.policies.typed_counts import assign_types, best_start
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register
from scheduler.steady import NO_PROMISE, Steadiness, attained_order_change, unchanged

# Tie-break bonus (utility units) for being allocated, spread over the jobs' ranks. Utility
# differences that matter are >= 1e-3 or so (speedups of order 1); this only orders equals.
_TIE_BREAK = 1e-6
# Local search moves at most this many GPUs between two jobs at once.
_MAX_STEP = 16
# Improvements below this (relative to the total utility scale) end the local search.
_TOLERANCE = 1e-12


@dataclass(frozen=True)
class SpeedupTable:
    """Everything the count search needs, one row per job of the snapshot (in snapshot order).

    ``utility[j, g]`` is job j's term of the objective with g GPUs (-inf where g is not
    allowed); ``speedup[j, g]`` the speedup with the restart penalty applied (0 at g = 0,
    NaN where not allowed), packed on the fewest nodes — except that keeping the current
    count is priced where the job runs now. ``split[j, g]`` is the (penalized) speedup of a
    job that would fit on one node (g <= per_node) but is spread over two or more.
    """

    jobs: tuple[JobInfo, ...]
    capacity: int                 # GPUs the policy may hand out
    per_node: int                 # GPUs per node ("packed" means ceil(g / per_node) nodes)
    current: np.ndarray           # GPUs each job holds now (where it can stay)
    speedup: np.ndarray
    split: np.ndarray
    raw: np.ndarray               # speedup (packed) before the restart penalty
    raw_split: np.ndarray         # split speedup before the restart penalty
    utility: np.ndarray
    factor: np.ndarray            # per job: restart penalty factor
    tie_break: np.ndarray         # per job: utility bonus for being allocated (orders equals)
    estimates: JobTable


# (id of a job model, lowest count, highest count, GPUs per node, with split candidates) ->
# (the model, packed speedups of the counts, split speedups of the counts 2..per_node among
# them). A model is kept in its entry so its id is not reused while the entry lives.
_SPEEDUP_ROWS: dict[tuple[int, int, int, int, bool], tuple[object, np.ndarray, np.ndarray]] = {}
_SPEEDUP_ROWS_LIMIT = 50_000


def remembered_speedups(estimates: JobTable, jobs, low: np.ndarray, high: np.ndarray, sizes: np.ndarray,
                        rows: np.ndarray, spread: np.ndarray | None, nodes: np.ndarray | None, per_node: int) -> np.ndarray:
    """Speedups (one GPU base, no cache, IO unlimited) of every candidate of :meth:`PolluxPolicy.speedup_table`:
    the packed candidates ``rows`` then the split ones ``rows[spread]``, in that order
    (``spread`` None: the packed ones only, as DeepBoot prices).

    Every round prices every active job again though only arrivals are new; a job's row
    depends on its model (fixed while it runs), its count range and the node size only, so
    rows are remembered and only unseen ones predicted (the same numbers: same inputs).
    """
    n = len(jobs)
    with_split = spread is not None
    if spread is None:
        spread = np.zeros(rows.size, dtype=bool)
        nodes = np.zeros(rows.size, dtype=np.int64)
    packed_start = np.cumsum(sizes) - sizes
    split_sizes = np.bincount(rows[spread], minlength=n)
    split_start = rows.size + np.cumsum(split_sizes) - split_sizes
    values = np.empty(rows.size + int(split_sizes.sum()))
    models = [job.model for job in jobs]
    keys = [(id(m), lo, hi, per_node, with_split) for m, lo, hi in zip(models, low.tolist(), high.tolist())]
    missing = []
    for j, key in enumerate(keys):
        if not sizes[j]:
            continue
        found = _SPEEDUP_ROWS.get(key)
        if found is None or found[0] is not models[j]:
            missing.append(j)
            continue
        values[packed_start[j]:packed_start[j] + sizes[j]] = found[1]
        values[split_start[j]:split_start[j] + split_sizes[j]] = found[2]
    if missing:
        wanted = np.zeros(n, dtype=bool)
        wanted[missing] = True
        pick = np.concatenate([wanted[rows], wanted[rows[spread]]])
        every_row = np.concatenate([rows, rows[spread]])
        every_count = np.concatenate([np.arange(rows.size) - np.repeat(packed_start, sizes) + low[rows],
                                      (np.arange(rows.size) - np.repeat(packed_start, sizes) + low[rows])[spread]])
        predicted = estimates.predict(every_row[pick], every_count[pick], nodes[pick], per_node=per_node,
                                      cache_bytes=np.zeros(int(pick.sum())),
                                      remote_io_bytes_per_s=np.full(int(pick.sum()), np.inf)).speedup
        values[pick] = predicted
        if len(_SPEEDUP_ROWS) + len(missing) > _SPEEDUP_ROWS_LIMIT:
            _SPEEDUP_ROWS.clear()
        for j in missing:
            _SPEEDUP_ROWS[keys[j]] = (models[j], values[packed_start[j]:packed_start[j] + sizes[j]].copy(),
                                      values[split_start[j]:split_start[j] + split_sizes[j]].copy())
    return values


def with_model(job: JobInfo, model) -> JobInfo:
    """``job`` priced with ``model``: ``dataclasses.replace(job, model=model)`` without its
    per-call cost (type tables copy every job once per type and round; JobInfo has no
    ``__post_init__`` to run, so a copy of its fields is the same object)."""
    if job.model is model:
        return job
    clone = object.__new__(JobInfo)
    clone.__dict__.update(job.__dict__)
    clone.__dict__["model"] = model
    return clone


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
            cache, io = self.grants(snapshot, all_rows, all_counts)
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

    def grants(self, snapshot: ClusterSnapshot, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cache and IO each candidate (job ``rows[k]`` on ``counts[k]`` GPUs) is priced with
        (no cache, unlimited IO unless co-designing)."""
        n = len(snapshot.jobs)
        if not (self.codesign and co.is_active(snapshot)):
            return np.zeros(len(rows)), np.full(len(rows), np.inf)
        cache, _ = co.expected_grants(snapshot, [snapshot.jobs[r] for r in rows], gpus=counts)
        demand = io_demand(snapshot, snapshot.jobs)
        share = co.max_min_share([demand[job.job_id] for job in snapshot.jobs], [{}] * n, snapshot.storage_bandwidth_bytes_per_s, {})
        # A job that needs no IO at its requested size may need some at a larger one: give it the
        # share an unsatisfied job gets (at least), so its larger candidates are not priced at b = 0.
        unmet = [share[k] for k, job in enumerate(snapshot.jobs) if share[k] < demand[job.job_id] - 1e-9]
        level = max(unmet, default=snapshot.storage_bandwidth_bytes_per_s)
        return cache, np.maximum(share, level)[rows]

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
            return _solve_dp(utility, table.capacity)
        return _local_search(utility, table.capacity, start, self.local_search_moves)

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
        index = {job.job_id: i for i, job in enumerate(table.jobs)}
        placed = list(best)
        rows = np.array([index[job_id] for job_id in placed])
        gpus = np.array([sum(len(ix) for _, ix in best[job_id]) for job_id in placed])
        nodes = np.array([len(best[job_id]) for job_id in placed])
        if self.codesign and co.is_active(snapshot):
            cache, io = self.grants(snapshot, rows, gpus)
            batch = table.estimates.predict(rows, gpus, nodes, per_node=table.per_node, cache_bytes=cache,
                                            remote_io_bytes_per_s=io).batch_size
        else:  # no cache, IO not limiting: the batch each count and spread gives, remembered across rounds
            batch = best_batch_sizes([table.jobs[r].model for r in rows], gpus, nodes, per_node=table.per_node)
        if self.codesign and co.is_active(snapshot):
            sizes = {job_id: int(b) for job_id, b in zip(placed, batch)}
            return co.co_allocate(snapshot, best, placed, sizes, io=self.codesign_io)
        return Plan({job_id: Allocation(placement=best[job_id], batch_size=int(b)) for job_id, b in zip(placed, batch)})

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
        placed = list(placements)
        index = {job.job_id: i for i, job in enumerate(snapshot.jobs)}
        rows = np.array([index[job_id] for job_id in placed])
        gpus = np.array([sum(len(ix) for _, ix in placements[job_id]) for job_id in placed])
        nodes = np.array([len(placements[job_id]) for job_id in placed])
        on = [placement_type(placements[job_id], kinds, snapshot.jobs[index[job_id]]) for job_id in placed]
        if self.codesign and co.is_active(snapshot):
            cache, io = self.grants(snapshot, rows, gpus)
            estimates = JobTable([snapshot.jobs[r] for r in rows], gpu_types=on)
            batch = estimates.predict(np.arange(len(placed)), gpus, nodes, per_node=tables[0].per_node, cache_bytes=cache,
                                      remote_io_bytes_per_s=io).batch_size
        else:
            batch = best_batch_sizes([snapshot.jobs[r].model_on(t) for r, t in zip(rows, on)], gpus, nodes,
                                     per_node=tables[0].per_node)
        if self.codesign and co.is_active(snapshot):
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


def solve_counts(utility: np.ndarray, capacity: int, solver: str = "auto", dp_limit: int = 5_000_000,
                 moves: int = 200) -> np.ndarray:
    """Counts maximizing ``sum_j utility[j, g_j]`` with ``sum g <= capacity``: the exact DP when
    ``jobs x (capacity + 1) x width`` is within ``dp_limit`` (``solver="auto"``), else the hull
    greedy and local search."""
    n, width = utility.shape
    if n == 0 or capacity == 0 or width == 1:
        return np.zeros(n, dtype=np.int64)
    wanted = np.argmax(utility, axis=1)  # each job's best count, the fewest GPUs among equals
    if int(wanted.sum()) <= capacity:
        return wanted.astype(np.int64)  # room for every job's best: that is the optimum
    if solver == "auto":
        solver = "dp" if n * (capacity + 1) * width <= dp_limit else "greedy"
    if solver == "dp":
        return _solve_dp(utility, capacity)
    return _local_search(utility, capacity, _solve_hull_greedy(utility, capacity), moves)


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


def _solve_dp(utility: np.ndarray, capacity: int) -> np.ndarray:
    """Exact: maximize ``sum_j utility[j, g_j]`` subject to ``sum_j g_j <= capacity`` (group knapsack).

    Counts that no optimal answer can use are dropped first (:func:`_lagrangian_candidates`);
    when that leaves few per job, the DP runs over those only (:func:`_solve_sparse_dp`), else
    over every count (:func:`_solve_dense_dp`). Both return what the DP over every count
    returns: among equal totals, the same answer (tested against a brute-force DP).
    """
    candidates = _lagrangian_candidates(utility, capacity)
    if candidates is not None:
        return _solve_sparse_dp(utility, capacity, *candidates)
    return _solve_dense_dp(utility, capacity)


# The sparse DP pays off while the counts left per job are few (the 5,000-job typed simulation:
# ~6 of ~55 on average); past this many per job the dense DP is cheaper.
_SPARSE_PER_JOB = 16


def _lagrangian_candidates(utility: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(job, count)`` pairs that some optimal answer may use (sorted by job, then count), or
    None when too many are left for the sparse DP to pay.

    Lagrangian bound: for a price ``lam >= 0`` per GPU, ``UB = sum_j m_j + lam * capacity`` with
    ``m_j = max_g utility[j, g] - lam * g`` bounds every feasible total from above, and any
    feasible answer's total ``LB`` from below. An optimal answer ``x`` has
    ``sum_j (m_j - utility[j, x_j] + lam * x_j) <= UB - sum_j utility[j, x_j] <= UB - LB`` with
    every term non-negative, so a count whose slack ``m_j - utility[j, g] + lam * g`` exceeds
    ``UB - LB`` is in no optimal answer. ``lam`` is found by bisection on the GPUs the jobs want
    at that price (the dual's minimum is where that demand crosses ``capacity``); ``LB`` is the
    answer at the price just above it, its spare GPUs given to the jobs that want more just
    below it (best gain per GPU first).
    """
    n, width = utility.shape
    g = np.arange(width, dtype=np.float64)

    def demand(lam: float) -> np.ndarray:
        return np.argmax(utility - lam * g, axis=1)

    low, high = 0.0, 1.0
    for _ in range(64):  # raise the price until the demand fits
        if int(demand(high).sum()) <= capacity:
            break
        low, high = high, high * 16.0
    else:
        return None
    if low == 0.0:  # lower it until it does not (or to 0, where everything wanted fits)
        low = high
        while low > 1e-12 and int(demand(low).sum()) <= capacity:
            high, low = low, low / 16.0
        if int(demand(low).sum()) <= capacity:
            high = low = 0.0
    if high > 0.0:
        down, up = np.log(low), np.log(high)
        for _ in range(12):
            middle = 0.5 * (down + up)
            if int(demand(float(np.exp(middle))).sum()) > capacity:
                down = middle
            else:
                up = middle
        low, high = float(np.exp(down)), float(np.exp(up))
    counts = demand(high)
    more = demand(low)
    spare = capacity - int(counts.sum())
    wanting = np.flatnonzero(more > counts)
    if spare > 0 and wanting.size:
        gain = (utility[wanting, more[wanting]] - utility[wanting, counts[wanting]]) / (more[wanting] - counts[wanting])
        for j in wanting[np.argsort(-gain, kind="stable")].tolist():
            need = int(more[j] - counts[j])
            if need <= spare:
                counts[j] = more[j]
                spare -= need
    lower = float(utility[np.arange(n), counts].sum())
    reduced = utility - high * g
    best = reduced.max(axis=1)
    upper = float(best.sum()) + high * capacity
    # Slack for rounding: totals are sums of n terms of the utilities' magnitude.
    alive = (best[:, None] - reduced) <= (upper - lower) + 1e-9 * (abs(upper) + abs(lower) + 1.0)
    job, count = np.nonzero(alive)
    if job.size > _SPARSE_PER_JOB * n:
        return None
    return job, count


def _solve_sparse_dp(utility: np.ndarray, capacity: int, job: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The DP of :func:`_solve_dp` over the counts ``(job, count)`` only: per job, the best total
    with at most ``c`` GPUs for every ``c``, the smallest count among equals."""
    n, width = utility.shape
    padded = np.full(width + capacity + 1, -np.inf)  # padded[width + c]: best total over the jobs so far with <= c GPUs
    padded[width:] = 0.0
    # Row ``width - k`` of the windows is ``best[c - k]`` for every c (-inf for k > c).
    windows = np.lib.stride_tricks.sliding_window_view(padded, capacity + 1)
    choice = np.zeros((n, capacity + 1), dtype=np.int16 if width < 2**15 else np.int32)
    columns = np.arange(capacity + 1)
    starts = np.searchsorted(job, np.arange(n + 1)).tolist()
    for j in range(n):
        mine = count[starts[j]:starts[j + 1]]  # never empty: a job's best count has no slack
        options = windows[width - mine] + utility[j, mine][:, None]
        if mine.size == 1:
            padded[width:] = options[0]
            choice[j] = mine[0]
        else:
            pick = np.argmax(options, axis=0)  # the smallest count among equals (counts ascend)
            padded[width:] = options[pick, columns]
            choice[j] = mine[pick]
    return _walk_back(choice, capacity)


def _walk_back(choice: np.ndarray, capacity: int) -> np.ndarray:
    """The counts a DP's ``choice[j, c]`` table (job j's count with at most c GPUs for jobs
    0..j) picks, walked back from the last job at the full capacity."""
    counts = np.zeros(choice.shape[0], dtype=np.int64)
    c = capacity
    for j in range(choice.shape[0] - 1, -1, -1):
        counts[j] = choice[j, c]
        c -= counts[j]
    return counts


def _solve_dense_dp(utility: np.ndarray, capacity: int) -> np.ndarray:
    """:func:`_solve_dp` over every count of every job."""
    n, width = utility.shape
    # A count no better than some smaller count of its job is never chosen (the table ``best``
    # never falls with more GPUs and ties go to the smaller count): drop the columns past the
    # last count that beats every smaller one, of any job. The answer is the same.
    rises = utility[:, 1:] > np.maximum.accumulate(utility, axis=1)[:, :-1]
    last = np.where(rises.any(axis=1), width - 1 - np.argmax(rises[:, ::-1], axis=1), 0)  # per job
    own = np.minimum(last + 1, capacity + 1).tolist()  # each job's columns worth reading
    width = min(width, capacity + 1, max(own))
    utility = utility[:, :width]
    # value[c] of the new row = max_k best[c - k] + utility[j, k]; ``before[c, k]`` is
    # ``best[c - k]`` (-inf for k > c), a strided view of ``padded`` (no copy).
    padded = np.full(capacity + width, -np.inf)
    best = padded[width - 1:]  # best total using at most c GPUs over the jobs so far
    best[:] = 0.0
    before = np.lib.stride_tricks.sliding_window_view(padded, width)[:, ::-1]
    columns = np.arange(capacity + 1)
    choice = np.zeros((n, capacity + 1), dtype=np.int16 if width < 2**15 else np.int32)
    # Rows of job j worth computing: from ``floor[j]`` (the answer's capacity minus what the
    # later jobs can take: the walk back from ``capacity`` never goes lower, and job j + 1 reads
    # no row below it) up to ``reach`` (what the jobs so far can use: past it ``best`` is flat,
    # so those rows repeat row ``reach``). Rows outside keep stale values nobody reads.
    later = np.cumsum(np.array(own[::-1], dtype=np.int64) - 1)[::-1]  # jobs j.. together
    floor = np.maximum(0, capacity - (later - (np.array(own, dtype=np.int64) - 1))).tolist()
    reach = 0
    for j in range(n):
        reach = min(capacity, reach + own[j] - 1)
        low = min(floor[j], reach)
        options = before[low:reach + 1, :own[j]] + utility[j, :own[j]]
        pick = np.argmax(options, axis=1)  # the smallest count among equals
        choice[j, low:reach + 1] = pick
        best[low:reach + 1] = options[columns[:reach + 1 - low], pick]
        if reach < capacity:
            choice[j, reach + 1:] = pick[-1]
            best[reach + 1:] = best[reach]
    return _walk_back(choice, capacity)


def upper_hull_segments(utility: np.ndarray):
    """Edges of each job's upper concave hull of ``(g, utility[j, g])`` from g = 0, with rising utility.

    Returns arrays ``(job, start, end, slope)``; per job the slopes decrease.
    """
    n, width = utility.shape
    columns = np.arange(width)
    at = np.zeros(n, dtype=np.int64)
    active = np.isfinite(utility[:, 0])
    parts = []
    with np.errstate(invalid="ignore"):
        while active.any():
            rows = np.flatnonzero(active)
            step = columns[None, :] - at[rows, None]
            slope = (utility[rows] - utility[rows, at[rows]][:, None]) / np.where(step > 0, step, 1)
            slope = np.where((step > 0) & np.isfinite(slope), slope, -np.inf)
            # Farthest point among equal slopes: fewer, longer segments.
            end = width - 1 - np.argmax(slope[:, ::-1], axis=1)
            rise = slope[np.arange(rows.size), end]
            good = rise > 0
            parts.append((rows[good], at[rows[good]], end[good], rise[good]))
            at[rows[good]] = end[good]
            active[rows[~good]] = False
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, np.zeros(0)
    return tuple(np.concatenate(field) for field in zip(*parts))


def _solve_hull_greedy(utility: np.ndarray, capacity: int) -> np.ndarray:
    """Take hull segments in decreasing gain per GPU while they fit."""
    n = utility.shape[0]
    job, start, end, slope = upper_hull_segments(utility)
    counts = np.zeros(n, dtype=np.int64)
    blocked = np.zeros(n, dtype=bool)
    free = capacity
    for k in np.lexsort((job, -slope)):  # by slope, then job order
        j = job[k]
        if blocked[j] or counts[j] != start[k]:
            continue
        need = end[k] - start[k]
        if need <= free:
            counts[j] = end[k]
            free -= need
        else:
            blocked[j] = True  # its later segments start where this one ends
        if free == 0:
            break
    return counts


def _local_search(utility: np.ndarray, capacity: int, counts: np.ndarray, moves: int) -> np.ndarray:
    """Improve ``counts``: spend spare GPUs, or move GPUs from the cheapest donor to the best receiver."""
    n, width = utility.shape
    counts = counts.copy()
    # best_upto[j, c] = best utility with at most c GPUs, reached at best_at[j, c] GPUs.
    best_upto = np.maximum.accumulate(utility, axis=1)
    best_at = np.zeros((n, width), dtype=np.int64)
    improved = utility >= best_upto
    best_at[improved] = np.broadcast_to(np.arange(width), (n, width))[improved]
    best_at = np.maximum.accumulate(best_at, axis=1)
    scale = float(np.sum(np.abs(utility[np.arange(n), counts]))) or 1.0
    rows = np.arange(n)
    steps = np.arange(1, min(width, _MAX_STEP + 1))  # larger moves are the hull greedy's business
    for _ in range(moves):
        free = capacity - int(counts.sum())
        now = utility[rows, counts]
        # Receivers may use the spare GPUs plus `step` given up by a donor.
        up_at = np.minimum(counts[:, None] + steps[None, :] + free, width - 1)
        gain = best_upto[rows[:, None], up_at] - now[:, None]
        if free > 0:
            spend = best_upto[rows, np.minimum(counts + free, width - 1)] - now
            j = int(np.argmax(spend))
            if spend[j] > _TOLERANCE * scale:
                counts[j] = best_at[j, min(counts[j] + free, width - 1)]
                continue
        down_at = counts[:, None] - steps[None, :]
        loss = np.where(down_at >= 0, now[:, None] - best_upto[rows[:, None], np.maximum(down_at, 0)], np.inf)
        # Best receiver and donor per step size, with runners-up for when they are the same job.
        cols = np.arange(steps.size)
        r1, d1 = np.argmax(gain, axis=0), np.argmin(loss, axis=0)
        if n > 1:
            g1, l1 = gain[r1, cols], loss[d1, cols]
            gain[r1, cols], loss[d1, cols] = -np.inf, np.inf
            r2, d2 = np.argmax(gain, axis=0), np.argmin(loss, axis=0)
            gain[r1, cols], loss[d1, cols] = g1, l1
        else:
            r2, d2 = r1, d1
        same = r1 == d1
        alt_a = gain[r1, cols] - loss[d2, cols]
        alt_b = gain[r2, cols] - loss[d1, cols]
        value = np.where(same, np.maximum(alt_a, alt_b), gain[r1, cols] - loss[d1, cols])
        receiver = np.where(same & (alt_b > alt_a), r2, r1)
        donor = np.where(same & ~(alt_b > alt_a), d2, d1)
        value = np.where(receiver == donor, -np.inf, value)
        s = int(np.argmax(value))
        if not value[s] > _TOLERANCE * scale:
            break
        r, d = int(receiver[s]), int(donor[s])
        counts[d] = best_at[d, counts[d] - steps[s]]
        counts[r] = best_at[r, min(counts[r] + steps[s] + free, width - 1)]
    return counts
