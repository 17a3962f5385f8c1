"""Gavel: max-min fairness over normalized throughput, solved as an LP (Narayanan et al., OSDI'20).

Gavel writes a policy as an optimization over an *allocation* ``X``: ``X[j, c]`` is the
fraction of time job ``j`` runs with candidate allocation ``c``. Gavel's candidates are
accelerator types (which makes it heterogeneity-aware); here, on one GPU type, a candidate
is a GPU count: the job's requested count for a rigid job, and for an elastic job also its
minimum, its (capped) maximum and the powers of two in between. A later issue adds cache
and remote IO grants as further candidate dimensions (one more column set per grant
level, priced by the same estimator call, see :mod:`scheduler.policies.pollux_estimates`).

The LP (max-min fairness, Gavel's ``max_min_fairness`` policy)::

    maximize    t
    subject to  sum_c X[j,c] * thr[j,c] / ref[j]  >=  w_j * t      for every job j
                sum_c X[j,c]                      <=  1            for every job j
                sum_j sum_c X[j,c] * gpus[c]      <=  total GPUs
                X >= 0

- ``thr[j, c]`` is the job's rate of progress with candidate ``c`` (goodput in
  efficiency-weighted samples/s at the job's own batch size, or at the goodput-optimal one
  with ``adapt_batch``), packed on the fewest nodes, IO not limiting.
- Normalization (Gavel's: throughput relative to the job's throughput under an *equal
  share* of the cluster): ``ref[j] = max_c thr[j,c] * min(1, (G/N) / gpus[c])``, the best
  the job could do alone with ``1/N`` of the cluster's GPU-time (``G`` GPUs, ``N`` jobs). A
  job whose hardware throughput is twice another's is therefore not favoured or
  penalized; for rigid jobs on a crowded cluster the normalized rate is proportional to
  the job's GPU-time share (Gavel's scale-factor rule: a 1-GPU job gets ``k`` times the
  time of a ``k``-GPU job with the same throughput).
- ``w_j = priority_base ** job.priority`` (1 for priority 0): larger priorities get
  proportionally more.
- ``water_fill`` (default on) solves a second LP that keeps every job at or above the
  max-min level ``t*`` and maximizes the sum of normalized throughputs, so capacity the
  bottleneck jobs cannot use is not left idle (Gavel's plain max-min LP leaves it
  arbitrary). On one GPU type every job can reach its equal share, so ``t*`` is 1 unless
  priorities differ; the second LP is what hands out the rest.
- Size: a candidate below the upper concave hull of its job's ``(gpus, normalized)``
  points (from ``(0, 0)``) is dominated by mixing two hull candidates, so only hull
  candidates become LP columns (2-3 per elastic job). The constraint matrix is built with
  ``scipy.sparse`` and solved by HiGHS' interior-point method through
  ``scipy.optimize.linprog`` (2,000 jobs: about 0.1 s per LP; the dual simplex stalls on
  the degenerate max-min LP). Jobs whose minimum exceeds the cluster have no candidate and
  no fairness row.

Cache and remote IO (``codesign``, SiloD; off by default). The cache split is fixed first:
each job is priced at the cache :func:`scheduler.codesign.expected_grants` expects for it,
and with the whole storage budget, so ``thr[j, c] = T(g, c, b)`` and a candidate uses
``io[j, c] = min(b*, budget)`` bytes/s while it runs. Remote IO is then one more capacity
row of the LP, ``sum_j sum_c X[j,c] * io[j,c] <= storage budget``, as DESIGN.md suggests.
Counts above the requested one are offered only while the budget covers every job's IO
demand at its requested count (:func:`_growth_allowed`). The plan's cache and IO come from
:func:`scheduler.codesign.co_allocate`, and jobs its IO
grants would starve are left out of the round so their GPUs go to the next jobs
(:func:`scheduler.codesign.without_starved`).

Rounds (Gavel's round-based mechanism): the LP gives each job a target GPU share
``a_j = sum_c X[j,c] * gpus[c]`` (GPUs on average); the share it has received so far is
``attained_gpu_s / (time since arrival)``. Jobs are taken in decreasing ``a_j / received``
(never-run jobs first; ties by arrival), each with its most-weighted candidate count (an
elastic job takes what is left if that does not fit, down to its minimum), until the GPUs
run out.
Running jobs may get a bonus (``running_bonus``: priority multiplied by ``1 + bonus``) to
limit preemption churn when rounds are short compared with the restart cost; 0 is Gavel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from scheduler import codesign as co
from scheduler.placement import PlacementResult, place
from scheduler.policies.pollux import upper_hull_segments
from scheduler.policies.pollux_estimates import JobTable, gpus_per_node, held_in_place, pool_nodes
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register

# Relative slack on the max-min level when water-filling (keeps the second LP feasible
# under the first one's rounding).
_LEVEL_SLACK = 1e-7
# Time fractions below this are solver noise.
_NOISE = 1e-9


@dataclass(frozen=True)
class GavelAllocation:
    """The LP's answer: candidates (flattened) and the time fraction of each."""

    jobs: tuple[JobInfo, ...]
    job: np.ndarray               # job position of each candidate
    gpus: np.ndarray              # GPU count of each candidate
    throughput: np.ndarray        # rate of progress with the candidate (efficiency-weighted samples/s)
    reference: np.ndarray         # per job: throughput under an equal share (the normalizer)
    weight: np.ndarray            # per job: priority weight
    fraction: np.ndarray          # per candidate: share of time (the LP's X)
    level: float                  # the max-min normalized throughput t*
    io: np.ndarray | None = None  # per candidate: remote bytes/s it uses while running (codesign only)

    def time_fraction(self) -> np.ndarray:
        """Per job: share of time it should run (sum over its candidates)."""
        return np.bincount(self.job, weights=self.fraction, minlength=len(self.jobs))

    def target_gpus(self) -> np.ndarray:
        """Per job: GPUs it should hold on average."""
        return np.bincount(self.job, weights=self.fraction * self.gpus, minlength=len(self.jobs))

    def normalized_throughput(self) -> np.ndarray:
        """Per job: ``sum_c X[j,c] thr[j,c] / ref[j]``."""
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = self.fraction * np.where(self.reference[self.job] > 0, self.throughput / self.reference[self.job], 0.0)
        return np.bincount(self.job, weights=rate, minlength=len(self.jobs))


@register("gavel")
@dataclass(frozen=True)
class GavelPolicy:
    elastic: bool = True            # elastic jobs (min < max) may run at several counts
    max_gpus_per_job: int = 64      # cap on candidate counts (never below a job's min_gpus)
    adapt_batch: bool = False       # price candidates at the goodput-optimal batch and hand it out
    priority_base: float = 2.0      # weight = priority_base ** job.priority
    water_fill: bool = True         # second LP: use capacity the max-min bottleneck leaves over
    running_bonus: float = 0.0      # priority x (1 + bonus) for jobs running now; 0 = Gavel
    codesign: bool = False          # SiloD: price with T(g, c, b), IO as an LP constraint, grant cache and IO

    def __post_init__(self):
        if self.max_gpus_per_job < 1:
            raise ValueError("max_gpus_per_job must be at least 1")
        if not self.priority_base > 0:
            raise ValueError("priority_base must be positive")
        if not self.running_bonus >= 0:
            raise ValueError("running_bonus must be non-negative")

    # -- candidates and the LP -----------------------------------------------------------

    def candidate_counts(self, job: JobInfo, capacity: int) -> list[int]:
        """GPU counts the LP may give ``job`` (empty if not even its minimum fits the cluster)."""
        if job.min_gpus > capacity:
            return []
        high = min(max(min(job.max_gpus, self.max_gpus_per_job), job.min_gpus), capacity)
        requested = min(max(job.requested, job.min_gpus), high)
        if not self.elastic or job.rigid:
            return [requested]
        counts = {job.min_gpus, requested, high}
        power = 1
        while power < high:
            if power > job.min_gpus:
                counts.add(power)
            power *= 2
        return sorted(counts)

    def solve(self, snapshot: ClusterSnapshot) -> GavelAllocation:
        """The fractional allocation of ``snapshot`` (see the module docstring)."""
        jobs = tuple(snapshot.jobs)
        capacity = sum(node.gpus for node in pool_nodes(snapshot))
        per_node = gpus_per_node(snapshot)
        options = [self.candidate_counts(job, capacity) for job in jobs]
        sizes = np.array([len(o) for o in options], dtype=np.int64)
        job = np.repeat(np.arange(len(jobs)), sizes)
        gpus = np.array([g for o in options for g in o], dtype=np.int64)
        weight = np.array([self.priority_base ** job_.priority for job_ in jobs], dtype=np.float64)
        if gpus.size == 0:
            empty = np.zeros(0)
            return GavelAllocation(jobs, job, gpus, empty, np.zeros(len(jobs)), weight, empty, 0.0)
        batch = 0 if self.adapt_batch else np.array([jobs[j].initial_batch_size for j in job], dtype=np.int64)
        io_row = None
        if self.codesign and co.is_active(snapshot):
            cache, _ = co.expected_grants(snapshot, [jobs[j] for j in job], gpus=gpus)
            budget = snapshot.storage_bandwidth_bytes_per_s
            pred = JobTable(jobs).predict(job, gpus, 0, per_node=per_node, batch_size=batch, cache_bytes=cache,
                                          remote_io_bytes_per_s=budget)
            throughput = pred.goodput_samples_per_s
            io_demand = pred.io_demand_bytes_per_s
            io_row = np.minimum(io_demand, budget)
        else:
            throughput = JobTable(jobs).predict(job, gpus, 0, per_node=per_node, batch_size=batch).goodput_samples_per_s
        share = capacity / len(jobs)
        reference = np.zeros(len(jobs))
        np.maximum.at(reference, job, throughput * np.minimum(1.0, share / gpus))
        with np.errstate(divide="ignore", invalid="ignore"):
            normalized = np.where(reference[job] > 0, throughput / reference[job], 0.0)
        keep = _undominated(job, gpus, normalized, len(jobs))
        if io_row is not None and np.isfinite(snapshot.storage_bandwidth_bytes_per_s):
            keep &= _growth_allowed(job, gpus, io_demand, jobs, snapshot.storage_bandwidth_bytes_per_s)
        job, gpus, throughput, normalized = job[keep], gpus[keep], throughput[keep], normalized[keep]
        if io_row is not None:
            io_row = io_row[keep]
            budget = snapshot.storage_bandwidth_bytes_per_s
            fraction, level = _max_min_lp(job, gpus, normalized, weight, len(jobs), capacity, self.water_fill,
                                          io_row if np.isfinite(budget) else None, budget)
        else:
            fraction, level = _max_min_lp(job, gpus, normalized, weight, len(jobs), capacity, self.water_fill)
        return GavelAllocation(jobs, job, gpus, throughput, reference, weight, fraction, level, io_row)

    # -- the round -----------------------------------------------------------------------

    def round_priorities(self, snapshot: ClusterSnapshot, allocation: GavelAllocation) -> np.ndarray:
        """Per job: target GPU share over the share received so far (inf if it never ran)."""
        target = allocation.target_gpus()
        received = np.array(
            [job.attained_gpu_s / (snapshot.time_s - job.submit_time_s) if snapshot.time_s > job.submit_time_s else 0.0
             for job in allocation.jobs]
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            priority = np.where(received > 0, target / np.where(received > 0, received, 1.0), np.where(target > _NOISE, np.inf, 0.0))
        if self.running_bonus:
            running = held_in_place(snapshot, allocation.jobs) > 0
            priority = np.where(running, priority * (1.0 + self.running_bonus), priority)
        return priority

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if not snapshot.jobs:
            return Plan({})
        allocation = self.solve(snapshot)
        jobs = allocation.jobs
        priority = self.round_priorities(snapshot, allocation)
        order = sorted(range(len(jobs)), key=lambda j: (-priority[j], jobs[j].submit_time_s, jobs[j].job_id))
        # Each job's most-weighted candidate count (the smaller one among near-equal weights).
        preferred = np.zeros(len(jobs), dtype=np.int64)
        ranked = np.lexsort((allocation.gpus, -np.round(allocation.fraction / 1e-6), allocation.job))
        first = ranked[np.r_[True, allocation.job[ranked][1:] != allocation.job[ranked][:-1]]] if ranked.size else ranked
        preferred[allocation.job[first]] = allocation.gpus[first]
        def admit(excluded: frozenset[str]):
            free = sum(node.gpus for node in pool_nodes(snapshot))
            counts: dict[str, int] = {}
            for j in order:
                if free == 0:
                    break
                want, job = int(preferred[j]), jobs[j]
                if want == 0 or job.job_id in excluded:
                    continue
                if want > free and self.elastic and not job.rigid:
                    want = free if free >= job.min_gpus else 0  # an elastic job takes what is left
                if 0 < want <= free:
                    counts[job.job_id] = want
                    free -= want
            return place(snapshot, counts, list(counts)).placements, list(counts)

        if allocation.io is not None:
            return co.without_starved(snapshot, admit)
        placements, _ = admit(frozenset())
        result = PlacementResult(placements, ())
        batch = self._batch_sizes(snapshot, result.placements)
        return Plan({job_id: Allocation(placement=p, batch_size=batch.get(job_id, 0)) for job_id, p in result.placements.items()})

    def _batch_sizes(self, snapshot: ClusterSnapshot, placements) -> dict[str, int]:
        if not self.adapt_batch or not placements:
            return {}
        jobs = [job for job in snapshot.jobs if job.job_id in placements]
        table = JobTable(jobs)
        gpus = [sum(len(ix) for _, ix in placements[job.job_id]) for job in jobs]
        nodes = [len(placements[job.job_id]) for job in jobs]
        batch = table.predict(np.arange(len(jobs)), gpus, nodes, per_node=gpus_per_node(snapshot)).batch_size
        return {job.job_id: int(b) for job, b in zip(jobs, batch)}


def _growth_allowed(job: np.ndarray, gpus: np.ndarray, io: np.ndarray, jobs, budget: float) -> np.ndarray:
    """All candidates while the storage budget has slack; only counts up to each job's
    requested one once the jobs' IO demands at their requested counts exceed it.

    The LP prices every candidate with the whole budget, so when storage is the bottleneck a
    larger count looks faster than it can be once the budget is shared. Offered anyway, the
    max-min solution moved jobs between counts (and so nodes and caches) round after round:
    on the storage-bound Philly scenario (docs/evaluation.md) gavel with co-design restarted
    each job hundreds of times and ran 2.9x slower than without co-design; offering growth
    only to jobs whose demand fits an equal share of the budget still churned (2,729
    restarts, 58,798 s), without growth it ran 31,598 s. When storage is not the bottleneck
    the extra GPUs can be fed and elastic Gavel is unchanged.
    """
    requested = np.array([max(j.requested, j.min_gpus) for j in jobs], dtype=np.int64)
    at_request = gpus == requested[job]
    if float(io[at_request].sum()) <= budget:
        return np.ones(job.size, dtype=bool)
    return gpus <= requested[job]


def _undominated(job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, n_jobs: int) -> np.ndarray:
    """Candidates on each job's upper concave hull of ``(gpus, normalized)`` from ``(0, 0)``.

    Any other candidate is matched or beaten, in the same time and with no more GPUs, by
    mixing two hull candidates (or a hull candidate and idling), so the LP never needs it.
    """
    width = int(gpus.max()) + 1
    value = np.full((n_jobs, width), -np.inf)
    value[:, 0] = 0.0
    value[job, gpus] = normalized
    hull_job, _, hull_end, _ = upper_hull_segments(value)
    on_hull = np.zeros((n_jobs, width), dtype=bool)
    on_hull[hull_job, hull_end] = True
    return on_hull[job, gpus]


def _max_min_lp(
    job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, weight: np.ndarray, n_jobs: int, capacity: int, water_fill: bool,
    io: np.ndarray | None = None, io_budget: float = np.inf,
) -> tuple[np.ndarray, float]:
    """Solve the max-min LP (and optionally the water-filling LP); return ``(X, t*)``.

    With ``io`` (bytes/s each candidate reads) the LP gets one more row: ``sum io x <= io_budget``.
    """
    m = job.size
    cols = np.arange(m)
    # Rows 0..n-1: w_j t - sum_c norm x <= 0; rows n..2n-1: sum_c x <= 1; row 2n: sum g x <= G.
    # Jobs without a candidate (their minimum exceeds the cluster) cannot hold the level down.
    fair = np.flatnonzero(np.bincount(job, minlength=n_jobs) > 0)
    rows = np.concatenate([job, n_jobs + job, np.full(m, 2 * n_jobs), fair])
    columns = np.concatenate([cols, cols, cols, np.full(fair.size, m)])
    values = np.concatenate([-normalized, np.ones(m), gpus.astype(np.float64), weight[fair]])
    extra = []
    if io is not None:  # row 2n+1: the storage budget
        rows = np.concatenate([rows, np.full(m, 2 * n_jobs + 1)])
        columns = np.concatenate([columns, cols])
        values = np.concatenate([values, io.astype(np.float64)])
        extra = [float(io_budget)]
    a_ub = sp.csr_matrix((values, (rows, columns)), shape=(2 * n_jobs + 1 + len(extra), m + 1))
    b_ub = np.concatenate([np.zeros(n_jobs), np.ones(n_jobs), [float(capacity)], extra])
    bounds = np.zeros((m + 1, 2))
    bounds[:m, 1] = 1.0
    bounds[m, 1] = np.inf
    objective = np.zeros(m + 1)
    objective[m] = -1.0
    first = linprog(objective, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs-ipm")
    if first.status != 0:
        raise RuntimeError(f"gavel LP failed: {first.message}")
    level = float(first.x[m])
    fraction = first.x[:m]
    if water_fill and level > 0:
        bounds[m] = level * (1 - _LEVEL_SLACK)
        second = linprog(np.concatenate([-normalized, [0.0]]), A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs-ipm")
        if second.status == 0:
            fraction = second.x[:m]
    return np.clip(fraction, 0.0, 1.0), level
