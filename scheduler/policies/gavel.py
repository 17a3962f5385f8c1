"""Gavel: max-min fairness over normalized throughput, solved as an LP (Narayanan et al., OSDI'20).

Gavel writes a policy as an optimization over an *allocation* ``X``: ``X[j, c]`` is the
fraction of time job ``j`` runs with candidate allocation ``c``. A candidate is a (GPU
count, GPU type) pair: the count is the job's requested count for a rigid job, and for an
elastic job also its minimum, its (capped) maximum and the powers of two in between; the
type is any type of the pool the job allows whose GPUs hold the count. Its throughput is the
job's goodput on that type (``JobInfo.model_on``), so the LP trades types by *effective
throughput* as Gavel does. Each type has its own capacity row. On an untyped cluster there
is one type and this is the homogeneous LP. ``heterogeneity_aware=False`` (the baseline)
collapses the types into one pool priced at the job's reference model (counts capped at the
largest type's GPUs) and lets the round put a count on a type in a speed-blind order
(:func:`scheduler.placement.blind_preferences`). Identical jobs (same candidates, throughputs
and weight: jobs of one application with the same bounds) are one row of the LP, exactly
(:func:`scheduler.policies.gavel_max_min.classes_lp`); a round of more than ``partition_jobs`` *distinct* jobs solves the same
LPs by prices on their capacity rows (:mod:`scheduler.policies.gavel_lp`), and ``partitions``
splits them POP-style (:func:`scheduler.policies.gavel_max_min.partitioned_lp`). After the LP's choices, leftover GPUs go to
waiting jobs at any count and type they fit. A later issue adds cache
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
  share* of the cluster): ``ref[j] = max_g sum_t (G_t/G) thr[j,(g,t)] min(1, (G/N) / g)``,
  the best the job could do alone with ``1/N`` of every type's GPU-time (``G_t`` GPUs of
  type ``t``, ``G`` in all, ``N`` jobs; Gavel's ``X^equal``).
- ``objective="makespan"``: ``ref[j]`` is the job's remaining work instead, so
  ``sum_c X thr / ref`` is the inverse of its finishing time and maximizing the minimum
  minimizes the makespan of the remaining work (Gavel's ``min_total_duration``, solved as
  the same LP; ``t*`` is 1 / makespan in seconds). A
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
  ``scipy.optimize.linprog`` (2,000 distinct jobs: about 0.1 s per LP on one type, 0.4 s on
  three; the dual simplex stalls on the degenerate max-min LP). Jobs of one class
  (:func:`scheduler.policies.gavel_max_min.job_classes`) share one set of columns whose capacity use is scaled by the class
  size, so a 20,000-job round of a few dozen kinds of job is an LP of a few dozen rows. Jobs
  whose minimum exceeds the cluster have no candidate and no fairness row.
- More than ``partition_jobs`` (2,000) distinct jobs (with ``objective="makespan"`` every job's
  normalizer is its own): the whole LP, both stages, by Dantzig-Wolfe decomposition over the
  capacity rows (:func:`scheduler.policies.gavel_lp.solve_by_prices`): prices on the few
  capacity rows split the LP into one closed-form problem per job, and a small master LP
  combines the allocations they give. Its level is within 1e-6 of the LP's (it returns an
  upper bound as the certificate; :attr:`GavelAllocation.bound`), its water-filled total
  within 1e-4, and it works per *shape* (jobs whose candidates are the same up to the
  normalizer), so a 20,000-job makespan round of a few dozen applications and bounds costs
  about 0.1 s; 20,000 jobs with models of their own, 1.5-2 s.
  ``partitions=P`` splits the round POP-style into ``P`` HiGHS LPs instead.
- A round with room for every job's best candidate at once (a cluster with more GPUs than its
  jobs can use well) has one optimum, every job full time on its best candidate: it is
  answered without HiGHS (:mod:`scheduler.policies.gavel_fits`), and its plan is promised
  until a job arrives, jobs leaving included (:meth:`GavelPolicy.stable_until`).

Cache and remote IO (``codesign``, SiloD; off by default). The cache split is fixed first:
each job is priced at the cache :func:`scheduler.codesign.expected_grants` expects for it,
and with the whole storage budget, so ``thr[j, c] = T(g, c, b)`` and a candidate uses
``io[j, c] = min(b*, budget)`` bytes/s while it runs. Remote IO is then one more capacity
row of the LP, ``sum_j sum_c X[j,c] * io[j,c] <= storage budget``, as DESIGN.md suggests.
Counts above the requested one are offered only while the budget covers every job's IO
demand at its requested count (:func:`scheduler.policies.gavel_candidates.growth_allowed`). The plan's cache and IO come from
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

import operator
from dataclasses import dataclass

import numpy as np

from scheduler import codesign as co
from scheduler.gpu_type_choice import gpus_by_type
from scheduler.placement import (TypeRoom, blind_preferences, gpu_allocation, largest_type_gpus, node_types, place,
                                 placement_type)
from scheduler.policies import gavel_candidates as cand
from scheduler.policies import gavel_max_min as lps
from scheduler.policies.gavel_allocation import NOISE, GavelAllocation, forget_answers, ranked_choices, remembered
from scheduler.policies.gavel_fits import best_fits, fits_after_departures
from scheduler.policies.gavel_lp import solve_by_prices
from scheduler.policies.gavel_round import batch_sizes, fill, pick
from scheduler.policies.pollux_estimates import JobTable, gpus_per_node, held_in_place
from scheduler.policy import ClusterSnapshot, JobInfo, Plan
from scheduler.registry import register
from scheduler.steady import FOREVER, FOREVER_DEPARTURES, NO_PROMISE, Steadiness

OBJECTIVES = ("max_min_fairness", "makespan")


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
    heterogeneity_aware: bool = True  # candidates per GPU type at the job's speed there; False = one pool, type-blind
    objective: str = "max_min_fairness"  # or "makespan": finish every job's remaining work as early as possible
    partitions: int = 0             # POP: split jobs and every type's GPUs into this many HiGHS LPs; 0 = no split
    partition_jobs: int = 2000      # partitions = 0: more distinct jobs than this go to the price solver (gavel_lp)

    def __post_init__(self):
        if self.partitions < 0 or self.partition_jobs < 1:
            raise ValueError("partitions must be >= 0 and partition_jobs >= 1")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.max_gpus_per_job < 1:
            raise ValueError("max_gpus_per_job must be at least 1")
        if not self.priority_base > 0:
            raise ValueError("priority_base must be positive")
        if not self.running_bonus >= 0:
            raise ValueError("running_bonus must be non-negative")

    # -- candidates and the LP -----------------------------------------------------------

    def candidate_counts(self, job: JobInfo, capacity: int) -> list[int]:
        """GPU counts the LP may give ``job`` (empty if not even its minimum fits the cluster)."""
        counts = cand.count_matrix(*cand.bounds_of([job]), capacity, self.elastic, self.max_gpus_per_job)
        return [int(g) for g in counts[0] if g > 0]

    def pool_types(self, snapshot: ClusterSnapshot) -> tuple[tuple[str, ...], np.ndarray]:
        """``(types, GPUs of each)`` the LP sees: the pool's types, or one pool when type-blind."""
        by_type = gpus_by_type(snapshot)
        if not self.heterogeneity_aware:
            return ("",), np.array([sum(by_type.values())], dtype=np.int64)
        types = tuple(sorted(by_type))
        return types, np.array([by_type[t] for t in types], dtype=np.int64)

    def solve(self, snapshot: ClusterSnapshot) -> GavelAllocation:
        """The fractional allocation of ``snapshot`` (see the module docstring).

        Remembered for the last few rounds (:func:`_remembered`): with the max-min objective and
        without co-design, what the LP is built from does not change while no job arrives or
        leaves (progress and attained service do not enter it), so such a round reuses it.
        """
        last = _LAST_SOLVED
        if last is not None and last[1] is snapshot and last[0] == self:  # asked again for the same snapshot
            return last[2]
        allocation = self._solve_snapshot(snapshot)
        globals()["_LAST_SOLVED"] = (self, snapshot, allocation)
        return allocation

    def _solve_snapshot(self, snapshot: ClusterSnapshot) -> GavelAllocation:
        jobs = tuple(snapshot.jobs)
        types, type_capacity = self.pool_types(snapshot)
        per_node = gpus_per_node(snapshot)
        widest = largest_type_gpus(snapshot)
        if self.objective == "makespan" or (self.codesign and co.is_active(snapshot)):
            return self._solve(snapshot, jobs, types, type_capacity, per_node, widest)
        key = (self, types, type_capacity.tobytes(), per_node, widest, tuple(map(_FIELDS, jobs)),
               tuple(id(j.model) for j in jobs), tuple(id(j.type_models) for j in jobs))
        return remembered(key, jobs, lambda: self._solve(snapshot, jobs, types, type_capacity, per_node, widest))

    def _solve(self, snapshot, jobs, types, type_capacity, per_node, widest) -> GavelAllocation:
        codesign = self.codesign and co.is_active(snapshot)
        shape = None  # per job: equal for jobs with the same candidates and throughputs
        # No more distinct jobs than jobs: a round of at most partition_jobs never goes to the price
        # solver, and its shapes (what the price solver and the hulls of many jobs group by) are not needed.
        small = bool(self.partitions) or len(jobs) <= self.partition_jobs
        if codesign:
            job, gpus, kind = cand.candidates(jobs, types, type_capacity, widest, self.elastic, self.max_gpus_per_job)
        else:  # candidates and their throughputs, per kind of job, remembered across rounds
            job, gpus, kind, throughput, priced = cand.priced_candidates(jobs, types, type_capacity, widest, per_node,
                                                                         self.elastic, self.max_gpus_per_job,
                                                                         self.adapt_batch)
            if not small:
                shape = cand.shapes(priced, job, gpus, kind, throughput, len(jobs))
        weight = np.array([self.priority_base ** job_.priority for job_ in jobs], dtype=np.float64)
        if gpus.size == 0:
            empty = np.zeros(0)
            return GavelAllocation(jobs, job, gpus, empty, np.zeros(len(jobs)), weight, empty, 0.0, None, types, kind)
        io_row = None
        if codesign:
            # One priced row per (job, type) pair: the job's model on that type.
            pair, pair_of = np.unique(job * len(types) + kind, return_inverse=True)
            batch = 0 if self.adapt_batch else np.array([j.initial_batch_size for j in jobs], dtype=np.int64)[job]
            table = JobTable([jobs[p // len(types)] for p in pair], gpu_types=[types[p % len(types)] for p in pair])
            cache, _ = co.expected_grants(snapshot, [jobs[j] for j in job], gpus=gpus)
            budget = snapshot.storage_bandwidth_bytes_per_s
            pred = table.predict(pair_of.ravel(), gpus, 0, per_node=per_node, batch_size=batch, cache_bytes=cache,
                                 remote_io_bytes_per_s=budget)
            throughput = pred.goodput_samples_per_s
            io_demand = pred.io_demand_bytes_per_s
            io_row = np.minimum(io_demand, budget)
            if not small:
                shape = lps.job_classes(job, gpus, kind, throughput, np.zeros(len(jobs)), io_row, len(jobs))
        reference = self._reference(jobs, job, gpus, kind, throughput, type_capacity)
        with np.errstate(divide="ignore", invalid="ignore"):
            normalized = np.where(reference[job] > 0, throughput / reference[job], 0.0)
        # Jobs the LP cannot tell apart: the same candidates, throughputs, normalizer and weight.
        # Identical jobs share one LP row (_classes_lp), so the distinct jobs are what sizes an LP;
        # many go to the price solver (gavel_lp), which works per shape (same candidates, any factor).
        by_prices = not small and cand.count_distinct([shape, reference, weight]) > self.partition_jobs
        if by_prices:  # the hull does not depend on the normalizer: one per shape
            keep = cand.undominated_by(shape, job, kind, gpus, throughput, len(types))
        else:  # one per kind of job and normalizer (exactly what each job's own hull is; a few jobs: each its own)
            group = np.arange(len(jobs)) if small else cand.row_classes([shape, reference])
            keep = cand.undominated_by(group, job, kind, gpus, normalized, len(types))
        if io_row is not None and np.isfinite(snapshot.storage_bandwidth_bytes_per_s):
            keep &= cand.growth_allowed(job, gpus, io_demand, jobs, snapshot.storage_bandwidth_bytes_per_s)
        job, gpus, kind, throughput, normalized = job[keep], gpus[keep], kind[keep], throughput[keep], normalized[keep]
        budget = snapshot.storage_bandwidth_bytes_per_s
        if io_row is not None:
            io_row = io_row[keep]
        io_lp = io_row if io_row is not None and np.isfinite(budget) else None
        # Makespan: 1 / finishing times are ~1e-6 per second, which the interior-point method
        # handles badly (at 20,000 jobs one LP did not finish in minutes). The LP gets them in
        # units of a typical job's time alone on its best candidate (same optimum, scaled).
        scale = _time_unit(job, normalized, len(jobs)) if self.objective == "makespan" else 1.0
        bound = None
        if by_prices:  # many distinct jobs: the whole LP by prices on its capacity rows
            if io_row is not None:  # the growth rule may have split a shape
                shape = lps.job_classes(job, gpus, kind, throughput, np.zeros(len(jobs)), io_lp, len(jobs))
            with np.errstate(divide="ignore"):
                factor = np.where(reference > 0, scale / reference, 0.0)
            solved = solve_by_prices(job, gpus, kind, throughput, factor, weight, len(jobs), type_capacity,
                                     self.water_fill, shape, io_lp, budget)
            fraction, level, bound = solved.fraction, solved.level, solved.bound / scale
        elif (fits := self._fits(job, gpus, normalized * scale, weight, len(jobs), type_capacity, kind, io_lp)):
            fraction, level = fits  # what _classes_lp returns then (gavel_fits), without the classes
        else:
            klass = lps.job_classes(job, gpus, kind, normalized, weight, io_lp, len(jobs))
            fraction, level = lps.partitioned_lp(self.partition_count(len(jobs)), job, gpus, normalized * scale, weight,
                                              len(jobs), type_capacity, kind, self.water_fill, io_lp, budget, klass)
        return GavelAllocation(jobs, job, gpus, throughput, reference, weight, fraction, level / scale, io_row, types,
                               kind, bound)

    def _fits(self, job, gpus, normalized, weight, n_jobs, type_capacity, kind, io_lp):
        """:func:`best_fits` over every job (no IO row, one LP), else None: where it holds, :func:`scheduler.policies.gavel_max_min.classes_lp`
        gets the same from its classes (identical jobs have the same best, and GPU counts add up exactly)."""
        if io_lp is not None or self.partition_count(n_jobs) != 1:
            return None
        return best_fits(job, gpus, normalized, weight, n_jobs, type_capacity, kind, self.water_fill)

    def partition_count(self, n_jobs: int) -> int:
        """LPs to split a round of ``n_jobs`` jobs into (POP): ``partitions`` (at most one per job), 1 without."""
        return max(1, min(self.partitions, n_jobs))

    def _reference(self, jobs, job, gpus, kind, throughput, type_capacity) -> np.ndarray:
        """Per job: what its throughput is divided by (see the module docstring).

        Max-min fairness: the job's throughput under an equal share of the cluster, ``1/N`` of
        every type's GPU-time (Gavel's ``X^equal``), at its best count. Makespan: its remaining
        work, so the normalized rate is the inverse of its finishing time.
        """
        if self.objective == "makespan":
            return np.array([max(j.remaining_samples, 1.0) for j in jobs], dtype=np.float64)
        capacity = float(type_capacity.sum())
        share = capacity / len(jobs)
        # An equal share spread over the types in proportion to their GPUs.
        mixed = throughput * np.minimum(1.0, share / gpus) * (type_capacity[kind] / capacity)
        by_count = np.zeros((len(jobs), int(gpus.max()) + 1))
        np.add.at(by_count, (job, gpus), mixed)
        return by_count.max(axis=1)

    # -- the round -----------------------------------------------------------------------

    def round_priorities(self, snapshot: ClusterSnapshot, allocation: GavelAllocation) -> np.ndarray:
        """Per job: target GPU share over the share received so far (inf if it never ran)."""
        target = allocation.target_gpus()
        received = np.array(
            [job.attained_gpu_s / (snapshot.time_s - job.submit_time_s) if snapshot.time_s > job.submit_time_s else 0.0
             for job in allocation.jobs]
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            priority = np.where(received > 0, target / np.where(received > 0, received, 1.0), np.where(target > NOISE, np.inf, 0.0))
        if self.running_bonus:
            running = held_in_place(snapshot, allocation.jobs) > 0
            priority = np.where(running, priority * (1.0 + self.running_bonus), priority)
        return priority

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        if not snapshot.jobs or not snapshot.nodes:  # no nodes (all lost, none joined yet): no LP
            return Plan({})
        allocation = self.solve(snapshot)
        jobs = allocation.jobs
        priority = self.round_priorities(snapshot, allocation)
        order = np.lexsort((np.array([job.job_id for job in jobs]), np.array([job.submit_time_s for job in jobs]),
                            -priority)).tolist()
        choices = ranked_choices(allocation)
        blind = blind_preferences(snapshot, [job.job_id for job in jobs]) if not self.heterogeneity_aware else None
        # Per job, its candidates fastest first (sliced when a job needs them: few do).
        fastest = np.lexsort((-allocation.throughput, allocation.job))
        fastest_end = np.cumsum(np.bincount(allocation.job, minlength=len(jobs)))
        fastest_start = fastest_end - np.bincount(allocation.job, minlength=len(jobs))

        def admit(excluded: frozenset[str]):
            room = TypeRoom(snapshot)
            counts: dict[str, int] = {}
            preferences: dict[str, tuple[str, ...]] = {}

            def offer(choose) -> None:
                """Jobs without GPUs yet, in round order, take what ``choose(j, job)`` claims."""
                for j in order:
                    if room.total == 0:
                        break
                    job = jobs[j]
                    if job.job_id in counts or job.job_id in excluded:
                        continue
                    picked = choose(j, job)
                    if picked is not None:
                        counts[job.job_id], preferences[job.job_id] = picked

            offer(lambda j, job: pick(job, allocation, choices[j], room, blind, self.elastic) if choices[j] else None)
            # Work conservation: GPUs the LP's choices left over go to jobs still waiting, in
            # the same order, on any type they may use (fastest first) and any count they fit.
            offer(lambda j, job: fill(job, allocation, fastest[fastest_start[j]:fastest_end[j]].tolist(), room,
                                      blind, self.elastic, self.max_gpus_per_job))
            # Still GPUs left: elastic jobs that start (or move) this round anyway grow into them
            # on their type; a job running in place is not restarted for a few more GPUs.
            for j in order:
                job = jobs[j]
                if room.total == 0:
                    break
                if job.job_id not in counts or job.rigid or not self.elastic or snapshot.current.get(job.job_id):
                    continue
                gpu_type = preferences[job.job_id][0]
                extra = min(room.room.get(gpu_type, 0), room.left,
                            min(job.max_gpus, self.max_gpus_per_job) - counts[job.job_id])
                if extra > 0 and room.claim(extra, (gpu_type,)) is not None:
                    counts[job.job_id] += extra
            return place(snapshot, counts, list(counts), preferences=preferences).placements, list(counts)

        if allocation.io is not None:
            return co.without_starved(snapshot, admit)
        placements, _ = admit(frozenset())
        batch = batch_sizes(snapshot, placements) if self.adapt_batch else {}
        kinds = node_types(snapshot)
        # place() keeps every job on one type: a one-node placement's type is its node's.
        current = snapshot.current.allocations
        return Plan({job_id: gpu_allocation(current.get(job_id), p, batch.get(job_id, 0),
                                            kinds[p[0][0]] if len(p) == 1 else placement_type(p, kinds, None))
                     for job_id, p in placements.items()})

    def stable_until(self, snapshot: ClusterSnapshot, plan: Plan) -> Steadiness:
        """See scheduler.steady. A round's order moves with the clock (target over received
        share), but when the plan gives every job its first choice (the LP's most-weighted
        candidate), then shown that plan every job gets its choice whatever the order, keeps its
        GPUs, nobody waits for the leftovers and nobody is starting (so nobody grows): the same
        plan until the LP changes, i.e. until a job arrives or leaves. When every job's first choice
        is its best candidate, all of them fitting at once (:mod:`scheduler.policies.gavel_fits`),
        the LP of any jobs that stay is answered the same, so the promise covers departures too
        (the jobs are few enough for the LP itself, not the price solver, and not split, whoever
        leaves). The makespan objective's
        LP reads progress, co-design reads caches, and type-blind rounds try types in an order:
        no promise for those."""
        if (self.objective != "max_min_fairness" or (self.codesign and co.is_active(snapshot))
                or not self.heterogeneity_aware or not snapshot.jobs or not snapshot.nodes):
            return NO_PROMISE
        allocation = self.solve(snapshot)
        held = plan.allocations
        for j, candidates in enumerate(ranked_choices(allocation)):
            allocated = held.get(allocation.jobs[j].job_id)
            if allocated is None or not candidates:
                return NO_PROMISE
            first = candidates[0]
            if allocated.gpus != int(allocation.gpus[first]) or allocated.gpu_type != allocation.type_of(first):
                return NO_PROMISE
        if self.water_fill and self.partitions <= 1 and len(allocation.jobs) <= self.partition_jobs and \
                fits_after_departures(allocation, self.pool_types(snapshot)[1]):
            return FOREVER_DEPARTURES
        return FOREVER


def _time_unit(job: np.ndarray, normalized: np.ndarray, n_jobs: int) -> float:
    """Seconds: the median over jobs of 1 / the job's best normalized rate (with the makespan
    objective, its remaining time alone on its best candidate); 1 if there is none."""
    best = np.zeros(n_jobs)
    np.maximum.at(best, job, normalized)
    best = best[best > 0]
    return float(np.median(1.0 / best)) if best.size else 1.0


# The last snapshot solved (a round, then its promise, ask the same).
_LAST_SOLVED: tuple | None = None


# What GavelPolicy.solve reads of a job besides its models, which the key holds by identity (the
# job's model and its type_models mapping, a frozen JobInfo's value: the remembered entry holds
# both, so neither id is reused while it lives).
_FIELDS = operator.attrgetter("job_id", "min_gpus", "max_gpus", "requested_gpus", "batch_size", "priority", "gpu_types")


def forget_lps() -> None:
    """Drop the remembered LPs and their inputs (a benchmark times a round that solves its LP)."""
    global _LAST_SOLVED
    lps.forget_solved()
    forget_answers()
    _LAST_SOLVED = None


