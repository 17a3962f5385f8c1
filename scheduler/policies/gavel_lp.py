"""gavel's two LPs on rounds of many distinct jobs, solved through prices on the capacity rows.

The max-min LP and the water-filling LP of :mod:`scheduler.policies.gavel` couple their jobs
only through a few rows: one capacity row per GPU type (and the storage budget with co-design).
Put a price ``p_r`` on each such row and the LP falls apart into one small problem per job, with
a closed form: the cheapest way for a job to run at rate ``r`` is a point of the lower convex
envelope of ``(0, 0)`` (idling) and its candidates' ``(rate, price of what they use)`` points, a
mixture of at most two candidates. Hence (Dantzig-Wolfe decomposition):

- the *Lagrangian dual* ``L(p)`` -- the best level (or water-filled total) the jobs reach when each
  pays ``p`` for what it uses and the capacities are credited at ``p`` -- is an upper bound on the
  LP's optimum for every ``p >= 0``, and cheap to evaluate;
- every evaluation also yields an allocation (every job on its envelope). A convex combination of
  allocations keeps every job's own rows (its level, its time), so the *master* LP -- the best
  combination that keeps every capacity row -- is small: jobs are dealt by shape (below) into at
  most 64 blocks, each block combines the evaluations with weights of its own, so the master has
  a column per block and evaluation and a row or two per block. Its optimum is a lower bound (an
  allocation that achieves it), its duals the next prices (and, for the max-min LP, how much each
  block's level counts).

Rounds stop once the bounds are within ``tolerance`` of each other (relative; 1e-6 for the level,
1e-4 for the water-filled total), or once the gap stops shrinking (HiGHS' own tolerances on the
master reached): the level returned is reached by the allocation, and the upper bound comes back
as the certificate.

Jobs whose candidates are the same up to one factor on their normalized throughputs share a
*shape*: jobs of one application with the same bounds, whose normalizers differ (with
``objective="makespan"`` the normalizer is each job's remaining work). Envelopes are worked out
once per shape; a job enters through its demand (rate needed per unit of level) and its factor.
A 20,000-job round of a few dozen shapes costs a few milliseconds per evaluation.

Here: the two LPs' price oracles and the loop; the shapes, envelopes and master LP are
:mod:`scheduler.policies.gavel_decomposition`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.policies.gavel_decomposition import Envelopes, Keys, Master, Shapes

_BISECTIONS = 60      # halvings of the level's bracket
_MAX_ROUNDS = 300     # price evaluations per LP, at most
_STALLED = 25         # ... and stop after this many without the gap between the bounds shrinking 1 %
_LEVEL_TOLERANCE = 1e-6  # the max-min level: within this of the LP's (relative)
_FILL_TOLERANCE = 1e-4   # the water-filled total: within this of the water-filling LP's
_LEVEL_SLACK = 1e-7   # as gavel's: the water-filling LP keeps every job at level * (1 - this)
_USED = 1e-12         # combination weights below this are dropped
# The water-filling master starts from the max-min allocation, which fills some capacity exactly;
# rounding puts it up to about 1e-12 over, and HiGHS may then call that master infeasible (seen
# on an AMD EPYC host: 6e-13 over, "Infeasible" from every HiGHS method, feasible with 1e-12 less).
# So the column is entered as using this much less of a capacity it fills: far more than rounding,
# far less than any plan can tell.
_FIRST_COLUMN_MARGIN = 1e-9


@dataclass(frozen=True)
class Solved:
    fraction: np.ndarray   # per candidate: share of time (gavel's X)
    level: float           # the max-min level ``fraction`` reaches before water-filling (lower bound)
    bound: float           # an upper bound on the max-min LP's level (its Lagrangian dual)
    rounds: int            # price evaluations, both LPs together


class _MaxMin:
    """The max-min LP's oracle: at prices ``p`` and block weights ``alpha`` (summing to 1), every
    block ``b`` of jobs picks its level ``t_b`` to maximize ``alpha_b t_b - sum_j many_j
    cost_j(demand_j t_b)`` (every job of the block at rate ``demand_j t_b``, on its envelope)."""

    def __init__(self, s: Shapes):
        self.s = s
        self.group = None

    def _sums(self, e: Envelopes, log_rate: np.ndarray, level: np.ndarray):
        """Per shape and segment: sums of ``many`` and ``many * demand`` over the jobs whose rate at
        their shape's ``level`` is on the segment."""
        s = self.s
        vertices = e.rate.shape[1]
        if self.group is None or self.group.size != log_rate.size:
            self.group = np.repeat(np.arange(s.n_shapes), vertices)
        with np.errstate(divide="ignore"):
            shifted = log_rate - np.repeat(np.log(level), vertices)
        at = s.demand_keys.count(self.group, None, log_value=shifted).reshape(e.rate.shape)
        at[:, 0] = s.shape_start[:-1]
        # No job runs past its shape's last vertex (the level is at most where the first job
        # does): a job there by rounding is on the last segment, not lost.
        last = np.arange(vertices)[None, :] >= e.count[:, None] - 1
        at = np.where(last, s.shape_start[1:, None], at)
        return np.diff(s.sum_m[at], axis=1), np.diff(s.sum_md[at], axis=1)

    def __call__(self, e: Envelopes, capacity: np.ndarray, alpha: np.ndarray):
        """``(L(p, alpha), level per block, use per block)``."""
        s = self.s
        slope = np.where(np.isfinite(e.slope), e.slope, 0.0)
        with np.errstate(divide="ignore"):
            log_rate = np.log(e.rate.ravel())
        if s.n_blocks == s.n_shapes and s.n_shapes * e.rate.shape[1] * 8 <= s.shape.size:
            level = self._bisect(e, slope, log_rate, alpha)
        else:
            level = self._sweep(e, slope, alpha)
        shape_level = level[s.shape_block]
        m, md = self._sums(e, log_rate, np.maximum(shape_level, 1e-300))
        # A segment's jobs: many_j at its start vertex, moved toward its end by (rate - start) / run.
        run = np.where(e.run > 0, e.run, 1.0)
        toward = (shape_level > 0)[:, None] * (shape_level[:, None] * md - e.rate[:, :-1] * m) / run
        m = m * (shape_level > 0)[:, None]
        weight = np.zeros(e.rate.shape)
        weight[:, :-1] += m - toward
        weight[:, 1:] += toward
        block_use = e.use(s, weight)
        value = float(e.p @ capacity) + float(alpha @ level) - float(e.p @ block_use.sum(axis=0))
        return value, level, block_use

    def _bisect(self, e: Envelopes, slope: np.ndarray, log_rate: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        """Per shape (one block each): its best level by bisection on the price of one more unit of
        level (few shapes: each step costs a search per shape and vertex)."""
        s = self.s

        def marginal(level: np.ndarray) -> np.ndarray:  # just below ``level``
            return np.sum(slope * self._sums(e, log_rate, level)[1], axis=1)

        # No level past the first job's top counts (the LP's cannot be higher): capped there,
        # the master's columns stay on the optimum's scale.
        low, high = np.zeros(s.n_shapes), np.minimum(s.shape_t_max, s.t_max)
        done = marginal(high) <= alpha
        for _ in range(_BISECTIONS):
            middle = 0.5 * (low + high)
            above = marginal(np.maximum(middle, 1e-300)) > alpha
            high = np.where(above, middle, high)
            low = np.where(above, low, middle)
        return np.where(done, high, low)

    def _sweep(self, e: Envelopes, slope: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        """Per block: its best level exactly, from its jobs' vertices in level order (many shapes)."""
        s = self.s
        vertices = e.rate.shape[1]
        # Per job and inner vertex h (1 .. count - 2): at level rate_h / demand its slope steps up.
        inner = (np.arange(vertices)[None, :] >= 1) & (np.arange(vertices)[None, :] < e.count[:, None] - 1)
        shape_of_step, vertex_of_step = np.nonzero(inner)
        step = slope[shape_of_step, vertex_of_step] - slope[shape_of_step, vertex_of_step - 1]
        per_shape = np.bincount(shape_of_step, minlength=s.n_shapes)
        job_steps = per_shape[s.shape]
        job = np.repeat(np.arange(s.shape.size), job_steps)
        first = np.cumsum(per_shape) - per_shape
        which = first[s.shape[job]] + np.arange(job.size) - np.repeat(np.cumsum(job_steps) - job_steps, job_steps)
        md = s.many * s.demand
        with np.errstate(divide="ignore", invalid="ignore"):
            at = e.rate[shape_of_step[which], vertex_of_step[which]] / s.demand[job]
        block = s.block[job]
        block_max = np.full(s.n_blocks, s.t_max)  # (capped as in _bisect)
        np.minimum.at(block_max, s.shape_block, s.shape_t_max)
        keep = at < block_max[block]
        at, rise, block = at[keep], (md[job] * step[which])[keep], block[keep]
        start = np.bincount(s.block, weights=md * slope[s.shape, 0], minlength=s.n_blocks)
        order = np.lexsort((at, block))
        total = np.cumsum(rise[order])
        bounds = np.searchsorted(block[order], np.arange(s.n_blocks + 1))
        before = np.concatenate([[0.0], total])[bounds[:-1]]
        crossed = (start[block[order]] + total - before[block[order]]) > alpha[block[order]]
        # the first crossing of each block
        index = np.where(crossed, np.arange(order.size), order.size)
        first_cross = np.full(s.n_blocks, order.size)
        np.minimum.at(first_cross, block[order], index)
        padded = np.concatenate([at[order], [np.inf]])
        level = np.where(first_cross < order.size, padded[np.minimum(first_cross, order.size)], block_max)
        return np.where(start > alpha, 0.0, level)

    def rates(self, level: np.ndarray) -> np.ndarray:
        """Per job: its rate at its block's ``level``."""
        return self.s.demand * level[self.s.block]


class _WaterFill:
    """The water-filling LP's oracle: every job maximizes ``many (factor r - cost(r))`` over its
    rates ``r >= floor`` at prices ``p``."""

    def __init__(self, s: Shapes, floor: np.ndarray):
        self.s, self.floor = s, floor
        # Jobs by (shape, factor): at given prices, the segments worth their cost to a job are
        # those cheaper per unit of rate than its factor, a count that grows with the factor.
        self.by_factor = np.lexsort((s.factor, s.shape))
        self.factor_keys = Keys(s.shape[self.by_factor], s.factor[self.by_factor])
        # Per job: how many of its shape's candidates are slower than its floor.
        keys = Keys(np.repeat(np.arange(s.n_shapes), s.width), s.theta.ravel(), floor)
        self.floor_at = keys.count(s.shape, floor, side="left") - s.shape * s.width
        self.value = s.many * s.factor

    def choose(self, e: Envelopes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per job: ``(rate, segment, share)`` of its best rate at these prices."""
        s = self.s
        segments = e.slope.shape[1]
        at = self.factor_keys.count(np.repeat(np.arange(s.n_shapes), segments), e.slope.ravel())
        marks = np.bincount(at, minlength=s.shape.size + 1)
        cheaper = np.empty(s.shape.size, dtype=np.int64)
        cheaper[self.by_factor] = np.cumsum(marks)[:-1] - s.shape[self.by_factor] * segments
        best = e.rate[s.shape, cheaper]
        # The floor's segment: vertices below it are the origin and those of columns before floor_at.
        real = np.zeros((s.n_shapes, s.width + 1), dtype=np.int64)
        vertices = np.arange(e.vertex.shape[1])[None, :]
        distinct = (vertices >= 1) & (vertices < e.count[:, None])
        np.add.at(real, (np.nonzero(distinct)[0], e.vertex[distinct] + 1), 1)
        floor_segment = 1 + np.cumsum(real, axis=1)[s.shape, self.floor_at]
        raised = self.floor > best
        rate = np.where(raised, self.floor, best)
        segment = np.where(raised, floor_segment, np.maximum(cheaper, 1))
        start = e.rate[s.shape, segment - 1]
        run = e.run[s.shape, segment - 1]
        share = np.where(raised, np.clip((rate - start) / np.where(run > 0, run, 1.0), 0.0, 1.0), 1.0)
        return rate, segment, np.where(rate > 0, share, 0.0)

    def __call__(self, e: Envelopes, capacity: np.ndarray, alpha=None):
        """``(L(p), total per block, use per block)``."""
        s = self.s
        rate, segment, share = self.choose(e)
        vertices = e.rate.shape[1]
        index = s.shape * vertices + segment
        weight = np.bincount(index, weights=s.many * share, minlength=s.n_shapes * vertices)
        weight += np.bincount(index - 1, weights=s.many * (1.0 - share), minlength=s.n_shapes * vertices)
        use = e.use(s, weight.reshape(s.n_shapes, vertices))
        total = np.bincount(s.block, weights=self.value * rate, minlength=s.n_blocks)
        return float(e.p @ capacity) + float(total.sum()) - float(e.p @ use.sum(axis=0)), total, use

    def rates(self, e: Envelopes, level=None) -> np.ndarray:
        return self.choose(e)[0]


def _price_loop(oracle, s: Shapes, master: Master, capacity: np.ndarray, tolerance: float, start: np.ndarray):
    """Cutting planes on ``L`` (Dantzig-Wolfe on the LP) from prices ``start``: ``(weights, lower,
    upper, evaluations, rounds, last prices)``; an evaluation is ``(prices, value per block, hull)``."""
    upper, evaluated, p = np.inf, [], start
    alpha = np.full(s.n_blocks, 1.0 / s.n_blocks)
    weights, lower = None, -np.inf
    best_gap, since = np.inf, 0
    for rounds in range(1, _MAX_ROUNDS + 1):
        e = Envelopes(s, p)
        value, per_block, use = oracle(e, capacity, alpha)
        evaluated.append((p, per_block, (e.vertex.astype(np.int16), e.count)))
        master.add(per_block, use)
        upper = min(upper, value)
        # The optimum is between the bounds: values in a unit near the lower one, so that reduced
        # costs are not lost to HiGHS' tolerance, and none more than 1e4 of it.
        master.rescale(max(abs(lower) if np.isfinite(lower) else master.unit, abs(upper) * 1e-4))
        weights, lower, p, alpha = master.solve()
        gap = upper - lower
        if gap <= tolerance * abs(upper):
            break
        # Stalled (the master's tolerances reached before ours): stop.
        best_gap, since = (gap, 0) if gap < 0.99 * best_gap else (best_gap, since + 1)
        if since >= _STALLED:
            break
    return weights, lower, upper, evaluated, rounds, p


def _within(use: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """``use`` (block x resource) scaled, per resource it fills, to ``1 - _FIRST_COLUMN_MARGIN`` of
    ``capacity``."""
    total = use.sum(axis=0)
    room = capacity * (1 - _FIRST_COLUMN_MARGIN)
    full = total > room
    scaled = use.copy()
    scaled[:, full] *= room[full] / total[full]
    return scaled


def solve_by_prices(job, gpus, kind, rate, factor, weight, n_rows, type_capacity, water_fill, shape_of,
                    io=None, io_budget=np.inf, multiplicity=None, tolerance=_LEVEL_TOLERANCE,
                    fill_tolerance=_FILL_TOLERANCE) -> Solved:
    """gavel's max-min LP and, with ``water_fill``, its water-filling LP, over candidates ``(job,
    gpus, kind)`` whose normalized throughput is ``rate * factor[job]`` (``weight``, ``io`` and
    ``multiplicity`` as in gavel's LP); ``shape_of``: per row, equal for rows whose candidates are
    the same in ``(gpus, kind, rate, io)``, in the same order."""
    n_types = len(type_capacity)
    capacity = np.asarray(type_capacity, dtype=np.float64)
    if io is not None:
        capacity = np.concatenate([capacity, [float(io_budget)]])
    job = np.asarray(job, dtype=np.int64)
    s = Shapes(job, gpus, kind, np.asarray(rate, dtype=np.float64), factor, weight, n_rows, np.asarray(shape_of),
                n_types, io, multiplicity)
    if s.rows.size == 0 or not s.t_max > 0 or not np.all(capacity > 0):
        return Solved(np.zeros(job.size), 0.0, 0.0, 0)
    max_min = _MaxMin(s)
    master = Master(capacity, s.n_blocks, levels=True, unit=s.t_max)
    master.add(np.zeros(s.n_blocks), np.zeros((s.n_blocks, s.resources)))  # idling: keeps every capacity row
    weights, level, bound, evaluated, rounds, prices = _price_loop(max_min, s, master, capacity, tolerance,
                                                                   np.zeros(s.resources))
    fraction = np.zeros(job.size)
    for w, (p, levels, hull) in zip(weights[1:], evaluated):
        if np.any(w > _USED):
            Envelopes(s, p, hull).fractions(s, max_min.rates(levels), np.where(w > _USED, w, 0.0)[s.block], fraction)
    if not (water_fill and level > 0):
        return Solved(np.clip(fraction, 0.0, 1.0), level, bound, rounds)
    fill = _WaterFill(s, s.demand * level * (1 - _LEVEL_SLACK))
    # The max-min allocation keeps every floor and capacity: each block's first column.
    reached = np.sum(weights * np.array(master.values), axis=0)   # per block
    first = reached * np.bincount(s.block, weights=s.many * s.demand * s.factor, minlength=s.n_blocks)
    second = Master(capacity, s.n_blocks, levels=False, unit=float(first.sum()))
    second.add(first, _within(np.einsum("ib,ibr->br", weights, np.array(master.uses)), capacity))
    # A unit of level is worth sum(many * weight) of the water-filled total (every job at its floor):
    # the max-min prices so converted are where the water-filling ones start.
    start = prices * float(np.sum(s.many * s.factor * s.demand))
    weights2, _, _, evaluated2, rounds2, _ = _price_loop(fill, s, second, capacity, fill_tolerance, start)
    filled = fraction * weights2[0][s.candidate_block]
    for w, (p, _, hull) in zip(weights2[1:], evaluated2):
        if np.any(w > _USED):
            e = Envelopes(s, p, hull)
            e.fractions(s, fill.rates(e), np.where(w > _USED, w, 0.0)[s.block], filled)
    return Solved(np.clip(filled, 0.0, 1.0), level, bound, rounds + rounds2)
