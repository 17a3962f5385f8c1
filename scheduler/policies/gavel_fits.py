"""gavel's two LPs when every job fits at its best: the answer without solving them.

When each job's best candidate (the one of highest normalized throughput) can run full time
for every job at once, within each GPU type's capacity (and the storage budget), the
water-filling LP's optimum is that allocation and nothing else: ``sum_c X[j,c] norm[j,c] <=
max_c norm[j,c]`` for every ``X`` that keeps the job's time row, with equality only when all of
the job's time is on its best candidate (when that is strictly better than the others), so the
allocation that puts every job there maximizes every job's term of the water-filling objective
at once; and it keeps every floor of the max-min level, since the level ``t*`` is at most
``min_j max_c norm[j,c] / w_j``, which this allocation reaches. So ``X`` is 1 on every job's best
candidate and 0 elsewhere, and ``t* = min_j max_c norm[j,c] / w_j``, exactly (HiGHS' answer to
both LPs is the same allocation, up to its tolerances).

Required, else the LPs are solved: water-filling on (without it, the max-min LP alone has many
optima and HiGHS' vertex is the answer); a positive best for every job (a level of 0 skips the
water-filling); every job's best ahead of its other candidates by a relative margin
(:data:`MARGIN`), so that the best is one candidate (ties: many optima) and stays the best
whatever positive factor the job's normalizer puts on its values. The condition then holds for
every subset of the jobs as well, as long as their normalizers are positive: fewer jobs use
less. gavel promises its plan across departures on that (:meth:`GavelPolicy.stable_until`).
"""

from __future__ import annotations

import numpy as np

MARGIN = 1e-9  # a job's best candidate is ahead of its next by at least this (relative)


def best_fits(job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, weight: np.ndarray, n_jobs: int,
              type_capacity: np.ndarray, kind: np.ndarray, water_fill: bool, io: np.ndarray | None = None,
              io_budget: float = np.inf, multiplicity: np.ndarray | None = None,
              margin: float = MARGIN) -> tuple[np.ndarray, float] | None:
    """gavel's ``(X, t*)`` (:func:`scheduler.policies.gavel_max_min.solve_max_min_lp`, same arguments) when
    every job fits on its best candidate (the module docstring), its best ahead of the rest by
    ``margin``, else None."""
    if not water_fill or job.size == 0:
        return None
    order = np.lexsort((-normalized, job))  # per job, best first
    first = np.ones(order.size, dtype=bool)
    first[1:] = job[order[1:]] != job[order[:-1]]
    best = order[first]
    if not np.all(normalized[best] > 0) or not np.all(np.isfinite(normalized[best])):
        return None
    # The runner-up of every job with two or more candidates: the entry right after its best.
    after = np.flatnonzero(first) + 1
    second = after[after < order.size]
    second = second[~first[second]]
    if second.size and np.any(normalized[order[second]] >= normalized[order[second - 1]] * (1 - margin)):
        return None
    many = np.ones(n_jobs) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)
    rows = job[best]
    used = np.bincount(kind[best], weights=gpus[best] * many[rows], minlength=len(type_capacity))
    if np.any(used > np.asarray(type_capacity, dtype=np.float64)):
        return None
    if io is not None and float(np.sum(io[best] * many[rows])) > io_budget:
        return None
    fraction = np.zeros(job.size)
    fraction[best] = 1.0
    return fraction, float(np.min(normalized[best] / np.asarray(weight, dtype=np.float64)[rows]))


def fits_after_departures(allocation, type_capacity: np.ndarray) -> bool:
    """Is ``allocation`` (a :class:`scheduler.policies.gavel.GavelAllocation` of the max-min LP with
    water-filling, on ``type_capacity`` GPUs of each of its types) every job on its best candidate,
    all fitting at once, each best ahead of the rest by twice :data:`MARGIN`? Then for the jobs that
    remain after any of them leave, :func:`best_fits` holds and gives each the same candidate:
    fewer jobs use less, and the normalizers that change with the number of jobs put a positive
    factor on each job's values, which keeps its best ahead by more than :data:`MARGIN` (a job's
    normalizer stays positive: its best candidate's throughput is)."""
    if allocation.io is not None or allocation.job.size == 0:
        return False
    if np.any(np.bincount(allocation.job, minlength=len(allocation.jobs)) == 0):
        return False  # a job without candidates
    reference = allocation.reference[allocation.job]
    if not np.all(reference > 0):
        return False
    kind = allocation.gpu_type if allocation.gpu_type is not None else np.zeros(allocation.job.size, dtype=np.int64)
    fits = best_fits(allocation.job, allocation.gpus, allocation.throughput / reference, allocation.weight,
                     len(allocation.jobs), type_capacity, kind, True, margin=2 * MARGIN)
    return fits is not None and np.array_equal(fits[0], allocation.fraction)
