"""gavel's linear programs: the max-min LP and its water-filling second stage
(:func:`solve_max_min_lp`), solved by HiGHS' interior-point method (:class:`InteriorPoint`),
with identical jobs as one row (:func:`classes_lp`, exact), POP-style partitions
(:func:`partitioned_lp`) and the last few LPs remembered (:func:`max_min_lp`). The LP and its
normalisation are described in :mod:`scheduler.policies.gavel`."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

try:  # HiGHS' own bindings, which scipy >= 1.15 ships (and its linprog calls)
    from scipy.optimize._highspy import _core as _highs
except ImportError:  # older scipy: through linprog only
    _highs = None

from scheduler.policies.gavel_fits import best_fits
from scheduler.policies.pollux_estimates import row_codes

# Relative slack on the max-min level when water-filling (keeps the second LP feasible
# under the first one's rounding).
_LEVEL_SLACK = 1e-7


def partitioned_lp(
    parts: int, job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, weight: np.ndarray, n_jobs: int,
    type_capacity: np.ndarray, kind: np.ndarray, water_fill: bool, io: np.ndarray | None, io_budget: float,
    klass: np.ndarray,
) -> tuple[np.ndarray, float]:
    """POP (Narayanan et al., NSDI'21): job ``j`` goes to sub-problem ``j mod parts`` (jobs are in
    arrival order, so every part gets a like mix), each part gets ``1/parts`` of every type's
    GPUs (and of the storage budget), and the parts' LPs are solved one by one. Returns the
    stitched ``X`` and the lowest part's level. One part is the whole LP. ``klass``: each job's
    class (:func:`job_classes`); a part's identical jobs are solved as one (:func:`classes_lp`)."""
    if parts <= 1:
        return classes_lp(job, gpus, normalized, weight, n_jobs, type_capacity, kind, water_fill, io, io_budget, klass)
    fraction = np.zeros(job.size)
    level = np.inf
    part_of = job % parts
    for p in range(parts):
        mine = np.flatnonzero(part_of == p)
        if mine.size == 0:
            continue
        members = np.unique(job[mine])
        local = np.searchsorted(members, job[mine])
        share = np.where(p < type_capacity % parts, type_capacity // parts + 1, type_capacity // parts)  # remainders to low parts
        x, t = classes_lp(local, gpus[mine], normalized[mine], weight[members], members.size, share, kind[mine],
                           water_fill, io[mine] if io is not None else None, io_budget / parts, klass[members])
        fraction[mine] = x
        level = min(level, t)
    return fraction, float(level if np.isfinite(level) else 0.0)


def job_classes(job: np.ndarray, gpus: np.ndarray, kind: np.ndarray, normalized: np.ndarray, weight: np.ndarray,
                 io: np.ndarray | None, n_jobs: int) -> np.ndarray:
    """Per job: a class number (0, 1, ...), the same for jobs the LP cannot tell apart — equal
    weight and the same candidates (count, type, normalized throughput, IO) in the same order.

    Jobs of one application with the same bounds and batch size share their models, so a large
    round has few classes (a 20,000-job benchmark round: a few dozen).
    """
    columns = [gpus, kind, normalized] + ([io] if io is not None else [])
    code = row_codes(columns)
    order = np.argsort(job, kind="stable")
    counts = np.bincount(job, minlength=n_jobs)
    first = np.cumsum(counts) - counts
    position = np.empty(job.size, dtype=np.int64)
    position[order] = np.arange(job.size) - first[job[order]]
    width = int(counts.max(initial=0))
    signature = np.full((n_jobs, width + 1), -1, dtype=np.int64)
    signature[job, position] = code
    signature[:, width] = row_codes([weight])
    # Group rows by a hash of the signature, then check every row against its group's first:
    # exact, and much faster than sorting the rows (np.unique(axis=0)) on a large round.
    mixer = np.random.default_rng(0).integers(1, 2**61, size=width + 1, dtype=np.int64) | 1
    with np.errstate(over="ignore"):
        digest = (signature * mixer).sum(axis=1)
    _, first, klass = np.unique(digest, return_index=True, return_inverse=True)
    klass = klass.ravel()
    if not np.array_equal(signature, signature[first[klass]]):  # a hash collision: sort the rows instead
        _, klass = np.unique(signature, axis=0, return_inverse=True)
    return klass.ravel()


def classes_lp(
    job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, weight: np.ndarray, n_jobs: int,
    type_capacity: np.ndarray, kind: np.ndarray, water_fill: bool, io: np.ndarray | None, io_budget: float,
    klass: np.ndarray,
) -> tuple[np.ndarray, float]:
    """:func:`max_min_lp` with each class of identical jobs (``klass``) as one row of the LP.

    Exact, not an approximation: both LPs are unchanged by swapping two identical jobs, so
    averaging an optimal ``X`` over such swaps gives an optimal ``X`` (the LPs are convex) in
    which identical jobs have equal fractions. With ``X[j, c] = X[class, c]`` a class's
    fairness and time rows are any member's, its capacity (and IO) use is its size times one
    member's, and its water-filling objective is its size times one member's.
    """
    classes, first, size = np.unique(klass, return_index=True, return_counts=True)
    if classes.size == n_jobs:
        return max_min_lp(job, gpus, normalized, weight, n_jobs, type_capacity, kind, water_fill, io, io_budget)
    # Candidate positions within their job, to map every job's candidates onto its representative's.
    order = np.argsort(job, kind="stable")
    counts = np.bincount(job, minlength=n_jobs)
    start = np.cumsum(counts) - counts
    position = np.empty(job.size, dtype=np.int64)
    position[order] = np.arange(job.size) - start[job[order]]
    representative = first[np.searchsorted(classes, klass)]  # per job
    mine = np.flatnonzero(representative[job] == job)         # the representatives' candidates
    row = np.searchsorted(classes, klass[job[mine]])
    x, level = max_min_lp(row, gpus[mine], normalized[mine], weight[first], classes.size, type_capacity, kind[mine],
                           water_fill, io[mine] if io is not None else None, io_budget, multiplicity=size)
    solved = np.zeros(job.size)
    solved[mine] = x
    return solved[order[start[representative[job]] + position]], level


_SOLVED: OrderedDict[bytes, tuple[np.ndarray, float]] = OrderedDict()


_SOLVED_LOCK = threading.Lock()


_SOLVED_KEPT = 8


def max_min_lp(
    job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, weight: np.ndarray, n_jobs: int,
    type_capacity: np.ndarray, kind: np.ndarray, water_fill: bool,
    io: np.ndarray | None = None, io_budget: float = np.inf, multiplicity: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """:func:`solve_max_min_lp`, remembered for the last few distinct LPs: rounds in which no
    job arrived or left (and nothing else the LP reads changed) pose exactly the same LP, so
    its answer is reused. The key is every input, byte for byte. A round in which every job fits
    on its best candidate is answered without HiGHS (:func:`scheduler.policies.gavel_fits.best_fits`)."""
    fits = best_fits(job, gpus, normalized, weight, n_jobs, type_capacity, kind, water_fill, io, io_budget,
                     multiplicity)
    if fits is not None:
        return fits
    arrays = [np.asarray(job, np.int64), np.asarray(gpus, np.int64), np.asarray(normalized, np.float64),
              np.asarray(weight, np.float64), np.asarray(type_capacity, np.int64), np.asarray(kind, np.int64)]
    arrays += [np.asarray(a, np.float64 if a is io else np.int64) for a in (io, multiplicity) if a is not None]
    shape = (job.size, n_jobs, len(type_capacity), bool(water_fill), io is None, multiplicity is None, float(io_budget))
    key = repr(shape).encode() + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    with _SOLVED_LOCK:
        found = _SOLVED.get(key)
        if found is not None:
            _SOLVED.move_to_end(key)
            return found[0].copy(), found[1]
    fraction, level = solve_max_min_lp(job, gpus, normalized, weight, n_jobs, type_capacity, kind, water_fill, io,
                                        io_budget, multiplicity)
    with _SOLVED_LOCK:
        _SOLVED[key] = (fraction.copy(), level)
        while len(_SOLVED) > _SOLVED_KEPT:
            _SOLVED.popitem(last=False)
    return fraction, level


def solve_max_min_lp(
    job: np.ndarray, gpus: np.ndarray, normalized: np.ndarray, weight: np.ndarray, n_jobs: int,
    type_capacity: np.ndarray, kind: np.ndarray, water_fill: bool,
    io: np.ndarray | None = None, io_budget: float = np.inf, multiplicity: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Solve the max-min LP (and optionally the water-filling LP); return ``(X, t*)``.

    ``kind[c]`` is candidate ``c``'s GPU type (an index into ``type_capacity``, the GPUs of
    each type): one capacity row per type. With ``io`` (bytes/s each candidate reads) the LP
    gets one more row: ``sum io x <= io_budget``. ``multiplicity[j]``: how many identical jobs
    row ``j`` stands for (:func:`classes_lp`; default 1).
    """
    m = job.size
    many = np.ones(m) if multiplicity is None else multiplicity[job].astype(np.float64)
    cols = np.arange(m)
    n_types = len(type_capacity)
    # Rows 0..n-1: w_j t - sum_c norm x <= 0; rows n..2n-1: sum_c x <= 1; rows 2n..2n+T-1:
    # sum_{c of type} g x <= G_type. Jobs without a candidate (their minimum exceeds every
    # type) cannot hold the level down.
    fair = np.flatnonzero(np.bincount(job, minlength=n_jobs) > 0)
    rows = np.concatenate([job, n_jobs + job, 2 * n_jobs + kind, fair])
    columns = np.concatenate([cols, cols, cols, np.full(fair.size, m)])
    values = np.concatenate([-normalized, np.ones(m), gpus * many, weight[fair]])
    extra = []
    if io is not None:  # the last row: the storage budget
        rows = np.concatenate([rows, np.full(m, 2 * n_jobs + n_types)])
        columns = np.concatenate([columns, cols])
        values = np.concatenate([values, io * many])
        extra = [float(io_budget)]
    a_ub = sp.csr_matrix((values, (rows, columns)), shape=(2 * n_jobs + n_types + len(extra), m + 1))
    b_ub = np.concatenate([np.zeros(n_jobs), np.ones(n_jobs), type_capacity.astype(np.float64), extra])
    bounds = np.zeros((m + 1, 2))
    bounds[:m, 1] = 1.0
    bounds[m, 1] = np.inf
    objective = np.zeros(m + 1)
    objective[m] = -1.0
    lp = InteriorPoint(a_ub, b_ub)
    x = lp.solve(objective, bounds)
    if x is None:
        raise RuntimeError(f"gavel LP failed: {lp.message}")
    level = float(x[m])
    fraction = x[:m]
    if water_fill and level > 0:
        bounds[m] = level * (1 - _LEVEL_SLACK)
        second = lp.solve(np.concatenate([-normalized * many, [0.0]]), bounds)
        if second is not None:
            fraction = second[:m]
    return np.clip(fraction, 0.0, 1.0), level


class InteriorPoint:
    """``min c x`` subject to ``a_ub x <= b_ub`` and bounds, by HiGHS' interior-point method with
    crossover, exactly as ``linprog(method="highs-ipm")`` solves it (same solver, same options,
    the same answers bit for bit), for several objectives and bounds over one constraint matrix.

    Where scipy ships HiGHS' bindings the model is handed to HiGHS directly: linprog's input
    checks and result assembly cost about as much as HiGHS itself on the LPs of a simulated
    round (a few dozen rows). Each solve starts afresh, as a new linprog call would.
    """

    def __init__(self, a_ub: sp.csr_matrix, b_ub: np.ndarray):
        self.a_ub, self.b_ub = a_ub, b_ub
        self.message = ""
        self._solver = None
        if _highs is not None:
            a = a_ub.tocsc()
            a.sort_indices()
            lp = _highs.HighsLp()
            lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
            lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = a.shape[1], a.shape[0]
            lp.a_matrix_.format_ = _highs.MatrixFormat.kColwise
            lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
            lp.col_cost_ = np.zeros(a.shape[1])
            lp.col_lower_, lp.col_upper_ = np.zeros(a.shape[1]), np.zeros(a.shape[1])
            lp.row_lower_ = np.full(a.shape[0], -_highs.kHighsInf)
            lp.row_upper_ = np.asarray(b_ub, dtype=np.float64)
            solver = _highs._Highs()
            # linprog's settings for method="highs-ipm" (the rest are HiGHS' defaults, as there).
            for option, value in (("output_flag", False), ("log_to_console", False), ("presolve", "on"),
                                  ("solver", "ipm"), ("simplex_strategy", 1)):
                solver.setOptionValue(option, value)
            solver.passModel(lp)
            self._solver = solver
            self._columns = np.arange(a.shape[1], dtype=np.int32)

    def solve(self, objective: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
        """The optimal ``x`` (None if HiGHS found none; ``message`` says why)."""
        if self._solver is None:
            result = linprog(objective, A_ub=self.a_ub, b_ub=self.b_ub, bounds=bounds, method="highs-ipm")
            self.message = result.message
            return result.x if result.status == 0 else None
        solver, columns = self._solver, self._columns
        solver.clearSolver()
        solver.changeColsCost(columns.size, columns, np.asarray(objective, dtype=np.float64))
        upper = np.where(np.isfinite(bounds[:, 1]), bounds[:, 1], _highs.kHighsInf)
        solver.changeColsBounds(columns.size, columns, np.ascontiguousarray(bounds[:, 0], dtype=np.float64), upper)
        solver.run()
        status = solver.getModelStatus()
        if status != _highs.HighsModelStatus.kOptimal:
            self.message = solver.modelStatusToString(status)
            return None
        return np.array(solver.getSolution().col_value)


def forget_solved() -> None:
    """Drop the remembered LPs (gavel.forget_lps)."""
    with _SOLVED_LOCK:
        _SOLVED.clear()
