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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:  # HiGHS' own bindings, which scipy >= 1.15 ships
    from scipy.optimize._highspy import _core as _highs
except ImportError:  # older scipy: the master LP through linprog
    _highs = None
from scipy.optimize import linprog

_BISECTIONS = 60      # halvings of the level's bracket
_MAX_ROUNDS = 300     # price evaluations per LP, at most
_STALLED = 25         # ... and stop after this many without the gap between the bounds shrinking 1 %
_LEVEL_TOLERANCE = 1e-6  # the max-min level: within this of the LP's (relative)
_FILL_TOLERANCE = 1e-4   # the water-filled total: within this of the water-filling LP's
_LEVEL_SLACK = 1e-7   # as gavel's: the water-filling LP keeps every job at level * (1 - this)
_USED = 1e-12         # combination weights below this are dropped
_BLOCKS = 64          # the master LP's blocks of jobs, at most


@dataclass(frozen=True)
class Solved:
    fraction: np.ndarray   # per candidate: share of time (gavel's X)
    level: float           # the max-min level ``fraction`` reaches before water-filling (lower bound)
    bound: float           # an upper bound on the max-min LP's level (its Lagrangian dual)
    rounds: int            # price evaluations, both LPs together


class _Shapes:
    """The round's candidates by shape: per shape a table of its candidates by rate (columns),
    per job its shape, demand, factor and multiplicity."""

    def __init__(self, job, gpus, kind, rate, factor, weight, n_rows, shape_of, n_types, io, multiplicity):
        self.size = job.size
        self.resources = n_types + (io is not None)
        order = np.argsort(job, kind="stable") if np.any(job[1:] < job[:-1]) else np.arange(job.size)
        counts = np.bincount(job, minlength=n_rows)
        start = np.cumsum(counts) - counts
        rows = np.flatnonzero(counts > 0)
        shapes, first, self.shape = np.unique(shape_of[rows], return_index=True, return_inverse=True)
        self.shape = self.shape.ravel()
        self.n_shapes = shapes.size
        rep = rows[first]
        self.width = width = int(counts[rows].max(initial=1))
        column = np.arange(width)
        valid = column[None, :] < counts[rep][:, None]
        take = order[np.where(valid, start[rep][:, None] + column[None, :], 0)]
        by_rate = np.argsort(np.where(valid, rate[take], np.inf), axis=1, kind="stable")
        self.valid = np.take_along_axis(valid, by_rate, axis=1)
        take = np.take_along_axis(take, by_rate, axis=1)
        self.position = by_rate  # per shape and column: the candidate's position among its job's
        self.theta = np.where(self.valid, rate[take], np.inf)
        # What a column uses while it runs: gpus of its type (and io of the storage budget).
        self.kind = np.where(self.valid, kind[take], 0)
        self.gpus = np.where(self.valid, gpus[take], 0).astype(np.float64)
        self.io = np.where(self.valid, io[take], 0.0) if io is not None else None
        self.rows, self.order, self.first_candidate = rows, order, start[rows]
        self.factor = np.asarray(factor, dtype=np.float64)[rows]
        self.many = np.ones(rows.size) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)[rows]
        weight = np.asarray(weight, dtype=np.float64)[rows]
        with np.errstate(divide="ignore"):
            self.demand = np.where(self.factor > 0, weight / self.factor, np.inf)  # rate needed per unit of level
        top = np.where(self.valid, self.theta, 0.0).max(axis=1)
        with np.errstate(invalid="ignore"):
            reach = np.where(np.isfinite(self.demand), top[self.shape] / self.demand, 0.0)
        self.t_max = float(reach.min()) if rows.size else 0.0  # the level at which some job runs flat out
        self.shape_t_max = np.full(self.n_shapes, np.inf)
        np.minimum.at(self.shape_t_max, self.shape, reach)
        # Blocks: the master LP combines evaluated allocations block by block (a block of jobs
        # may take one evaluation's allocation and another block another's). One block per
        # shape, or shapes dealt round-robin into _BLOCKS blocks.
        self.n_blocks = min(self.n_shapes, _BLOCKS)
        self.shape_block = np.arange(self.n_shapes) % self.n_blocks
        self.block = self.shape_block[self.shape]
        self.candidate_block = self.block[np.searchsorted(rows, job)]
        # Jobs by (shape, demand), with running sums: totals over the jobs of a shape in a demand range.
        by_demand = np.lexsort((self.demand, self.shape))
        self.shape_start = np.searchsorted(self.shape[by_demand], np.arange(self.n_shapes + 1))
        self.sum_md = np.concatenate([[0.0], np.cumsum((self.many * self.demand)[by_demand])])
        self.sum_m = np.concatenate([[0.0], np.cumsum(self.many[by_demand])])
        self.demand_keys = _Keys(self.shape[by_demand], self.demand[by_demand])

    def candidates(self, row: np.ndarray, column: np.ndarray) -> np.ndarray:
        """Candidate index of column ``column`` of job ``row`` (positions among the active rows)."""
        return self.order[self.first_candidate[row] + self.position[self.shape[row], column]]


class _Keys:
    """Values sorted within groups, ``(group, value)``, as one sorted float array, so that one
    ``searchsorted`` answers many ``(group, value)`` queries (values compared on a log scale;
    ``queries``, when given, widens the scale to hold them)."""

    def __init__(self, group: np.ndarray, value: np.ndarray, queries: np.ndarray | None = None):
        every = value if queries is None else np.concatenate([value, queries])
        logs = np.log(every[(every > 0) & np.isfinite(every)])
        self.low = float(logs.min()) - 2.0 if logs.size else 0.0
        self.band = (float(logs.max()) + 2.0 - self.low if logs.size else 1.0) + 4.0
        self.keys = self.key(group, value)

    def key(self, group, value, log_value=None):
        if log_value is None:
            with np.errstate(divide="ignore", invalid="ignore"):
                log_value = np.log(np.maximum(value, 0.0))
        return group * self.band + (np.clip(log_value - self.low, 0.0, self.band - 2.0) + 1.0)

    def count(self, group, value, side="right", log_value=None) -> np.ndarray:
        """Per query: how many keys are at most (``right``) or below (``left``) it, over all groups."""
        return np.searchsorted(self.keys, self.key(group, value, log_value), side=side)


def _envelope(theta: np.ndarray, cost: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per shape: the vertices of the lower convex envelope of ``(0, 0)`` and the valid
    ``(theta, cost)`` points (sorted by theta): ``(columns, count)``; column 0 is the origin (-1),
    and past the last vertex the last one repeats. Of collinear points only the ends count."""
    n, width = theta.shape
    vertex = np.full((n, width + 1), -1, dtype=np.int64)
    count = np.ones(n, dtype=np.int64)
    at_x, at_y = np.zeros(n), np.zeros(n)
    live = np.arange(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        while live.size:  # gift wrapping, every shape at once: a vertex a step
            ahead = valid[live] & (theta[live] > at_x[live, None])
            more = ahead.any(axis=1)
            live, ahead = live[more], ahead[more]
            if not live.size:
                break
            slope = np.where(ahead, (cost[live] - at_y[live, None]) / (theta[live] - at_x[live, None]), np.inf)
            best = width - 1 - np.argmin(slope[:, ::-1], axis=1)  # the farthest of equal slopes
            vertex[live, count[live]] = best
            count[live] += 1
            at_x[live], at_y[live] = theta[live, best], cost[live, best]
    last = vertex[np.arange(n), count - 1]
    return np.where(np.arange(width + 1)[None, :] >= count[:, None], last[:, None], vertex), count


class _Envelopes:
    """Every shape's envelope at prices ``p``: per vertex its rate, cost and what it uses (gpus of a
    type, io), per segment its slope (cost per unit of rate)."""

    def __init__(self, s: _Shapes, p: np.ndarray, hull: tuple[np.ndarray, np.ndarray] | None = None):
        self.p = p
        n_types = s.resources - (s.io is not None)
        cost = s.gpus * p[s.kind] + (s.io * p[n_types] if s.io is not None else 0.0)
        if hull is None:  # (the envelope's vertices, worked out before at these prices)
            hull = _envelope(s.theta, np.where(s.valid, cost, np.inf), s.valid)
        self.vertex, self.count = hull[0].astype(np.int64), hull[1]
        origin = self.vertex < 0
        column = np.maximum(self.vertex, 0)
        shape = np.arange(s.n_shapes)[:, None]
        self.rate = np.where(origin, 0.0, s.theta[shape, column])           # shape x vertex
        self.gpus = np.where(origin, 0.0, s.gpus[shape, column])
        self.kind = s.kind[shape, column]
        self.io = np.where(origin, 0.0, s.io[shape, column]) if s.io is not None else None
        vertex_cost = np.where(origin, 0.0, cost[shape, column])
        self.run = np.diff(self.rate, axis=1)                               # shape x segment
        flat = self.run <= 0
        self.slope = np.where(flat, np.inf, np.diff(vertex_cost, axis=1) / np.where(flat, 1.0, self.run))
        self.n_types = n_types

    def use(self, s: _Shapes, weight: np.ndarray) -> np.ndarray:
        """Per block: what the vertices use, ``weight`` (shape x vertex) times each: block x resource."""
        block = np.broadcast_to(s.shape_block[:, None], weight.shape)
        out = np.bincount((block * s.resources + self.kind).ravel(), weights=(weight * self.gpus).ravel(),
                          minlength=s.n_blocks * s.resources).reshape(s.n_blocks, s.resources)
        if self.io is not None:
            out[:, self.n_types] += np.bincount(block.ravel(), weights=(weight * self.io).ravel(), minlength=s.n_blocks)
        return out

    def positions(self, s: _Shapes, rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per job at ``rate`` on its envelope: its segment (1-based, ``(start, end]`` holds the
        rate) and the share of the segment's end vertex in its mixture."""
        vertices = self.rate.shape[1]
        keys = _Keys(np.repeat(np.arange(s.n_shapes), vertices), self.rate.ravel(), rate)
        below = keys.count(s.shape, rate, side="left") - s.shape * vertices
        segment = np.clip(below, 1, vertices - 1)
        start = self.rate[s.shape, segment - 1]
        run = self.run[s.shape, segment - 1]
        share = np.clip((rate - start) / np.where(run > 0, run, 1.0), 0.0, 1.0)
        return segment, np.where(run > 0, share, 1.0) * (rate > 0)

    def fractions(self, s: _Shapes, rate: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        """Adds to ``out`` (per candidate) ``weight`` (per job) times its time share when every job
        runs at ``rate`` on its envelope (jobs of weight 0 skipped)."""
        row = np.flatnonzero(weight > 0)
        segment, share = self.positions(s, rate)
        segment, share, weight = segment[row], share[row], weight[row]
        shape = s.shape[row]
        for vertex, amount in ((self.vertex[shape, segment - 1], 1.0 - share), (self.vertex[shape, segment], share)):
            used = (vertex >= 0) & (amount > 0)
            np.add.at(out, s.candidates(row[used], vertex[used]), (weight * amount)[used])


class _MaxMin:
    """The max-min LP's oracle: at prices ``p`` and block weights ``alpha`` (summing to 1), every
    block ``b`` of jobs picks its level ``t_b`` to maximize ``alpha_b t_b - sum_j many_j
    cost_j(demand_j t_b)`` (every job of the block at rate ``demand_j t_b``, on its envelope)."""

    def __init__(self, s: _Shapes):
        self.s = s
        self.group = None

    def _sums(self, e: _Envelopes, log_rate: np.ndarray, level: np.ndarray):
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

    def __call__(self, e: _Envelopes, capacity: np.ndarray, alpha: np.ndarray):
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

    def _bisect(self, e: _Envelopes, slope: np.ndarray, log_rate: np.ndarray, alpha: np.ndarray) -> np.ndarray:
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

    def _sweep(self, e: _Envelopes, slope: np.ndarray, alpha: np.ndarray) -> np.ndarray:
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

    def __init__(self, s: _Shapes, floor: np.ndarray):
        self.s, self.floor = s, floor
        # Jobs by (shape, factor): at given prices, the segments worth their cost to a job are
        # those cheaper per unit of rate than its factor, a count that grows with the factor.
        self.by_factor = np.lexsort((s.factor, s.shape))
        self.factor_keys = _Keys(s.shape[self.by_factor], s.factor[self.by_factor])
        # Per job: how many of its shape's candidates are slower than its floor.
        keys = _Keys(np.repeat(np.arange(s.n_shapes), s.width), s.theta.ravel(), floor)
        self.floor_at = keys.count(s.shape, floor, side="left") - s.shape * s.width
        self.value = s.many * s.factor

    def choose(self, e: _Envelopes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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

    def __call__(self, e: _Envelopes, capacity: np.ndarray, alpha=None):
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

    def rates(self, e: _Envelopes, level=None) -> np.ndarray:
        return self.choose(e)[0]


class _Master:
    """The master LP over blocks ``b`` and evaluated allocations ``i``: weights ``w[b, i] >= 0``,
    ``sum_i w[b, i] = 1`` for every block and ``sum_{b, i} w[b, i] use[b, i] <= capacity``;
    ``max sum w value`` (water-filling), or ``max tau`` with ``sum_i w[b, i] level[b, i] >= tau``
    for every block (max-min). Warm-started simplex as columns arrive. Values enter in units of
    ``unit`` (about the optimum's size), so that HiGHS' tolerances are relative to it."""

    def __init__(self, capacity: np.ndarray, blocks: int, levels: bool, unit: float):
        self.capacity, self.blocks, self.levels = capacity, blocks, levels
        self.unit = unit if unit > 0 and np.isfinite(unit) else 1.0
        self.n_res = len(capacity)
        self.rows = self.n_res + blocks * (2 if levels else 1)
        self.n_cols = 0
        self.values: list[np.ndarray] = []   # per evaluation: per block
        self.uses: list[np.ndarray] = []     # per evaluation: block x resource
        lower = np.concatenate([np.full(self.n_res, -np.inf), np.ones(blocks), np.full(blocks * levels, -np.inf)])
        upper = np.concatenate([np.ones(self.n_res), np.ones(blocks), np.zeros(blocks * levels)])
        self._bounds = (lower, upper)
        self._columns: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (cost, rows, values) per batch
        self._solver = None
        if _highs is not None:
            lp = _highs.HighsLp()
            lp.num_col_, lp.num_row_ = 0, self.rows
            lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = 0, self.rows
            lp.a_matrix_.format_ = _highs.MatrixFormat.kColwise
            lp.a_matrix_.start_ = np.zeros(1, dtype=np.int32)
            lp.row_lower_ = np.where(np.isfinite(lower), lower, -_highs.kHighsInf)
            lp.row_upper_ = upper
            solver = _highs._Highs()
            for option, value in (("output_flag", False), ("log_to_console", False), ("solver", "simplex"),
                                  ("presolve", "off")):
                solver.setOptionValue(option, value)
            solver.passModel(lp)
            self._solver = solver
        if levels:  # tau: one in every level row, objective max tau
            self._add(np.array([-1.0]), [np.arange(self.n_res + blocks, self.rows)], [np.ones(blocks)])

    def _add(self, cost: np.ndarray, rows: list[np.ndarray], values: list[np.ndarray]) -> None:
        self._columns.append((cost, rows, values))
        self.n_cols += cost.size
        if self._solver is not None:
            starts = np.cumsum([0] + [r.size for r in rows])[:-1].astype(np.int32)
            self._solver.addCols(cost.size, cost, np.zeros(cost.size), np.full(cost.size, _highs.kHighsInf),
                                 int(sum(r.size for r in rows)), starts, np.concatenate(rows).astype(np.int32),
                                 np.concatenate(values).astype(np.float64))

    def add(self, value: np.ndarray, use: np.ndarray) -> None:
        """One evaluation: per block its value (level or water-filled total) and its use."""
        self.values.append(np.asarray(value, dtype=np.float64))
        self.uses.append(np.asarray(use, dtype=np.float64))
        scaled = use / self.capacity
        value = np.asarray(value, dtype=np.float64) / self.unit
        rows, values = [], []
        resources = np.arange(self.n_res)
        for b in range(self.blocks):
            level_row = [[self.n_res + self.blocks + b]] if self.levels else []
            rows.append(np.concatenate([resources, [self.n_res + b]] + level_row))
            values.append(np.concatenate([scaled[b], [1.0]] + ([[-value[b]]] if self.levels else [])))
        self._add(np.zeros(self.blocks) if self.levels else -value, rows, values)

    def rescale(self, unit: float) -> None:
        """Water-filling: values in units of ``unit`` from now on (the optimum's size is known
        better as allocations come in; within 10x of the old unit nothing changes)."""
        if self.levels or not (unit > 0 and np.isfinite(unit)) or 0.1 <= unit / self.unit <= 10:
            return
        self.unit = unit
        cost = -np.concatenate(self.values) / unit
        self._columns = [(cost[k * self.blocks:(k + 1) * self.blocks], rows, values)
                         for k, (_, rows, values) in enumerate(self._columns)]
        if self._solver is not None:
            self._solver.changeColsCost(cost.size, np.arange(cost.size, dtype=np.int32), cost)

    def solve(self):
        """``(weights, objective, prices, alpha)``: weights per evaluation and block (evaluations x
        blocks), prices the capacity rows' duals, ``alpha`` the level rows' (max-min)."""
        if self._solver is not None:
            solver = self._solver
            solver.run()
            status = solver.getModelStatus()
            if status != _highs.HighsModelStatus.kOptimal:
                raise RuntimeError(f"gavel master LP failed: {solver.modelStatusToString(status)}")
            solution = solver.getSolution()
            x, duals = np.array(solution.col_value), -np.array(solution.row_dual)
        else:
            x, duals = self._linprog()
        first = 1 if self.levels else 0
        weights = x[first:].reshape(-1, self.blocks)
        objective = float(x[0]) * self.unit if self.levels else float(np.sum(weights * np.array(self.values)))
        prices = np.maximum(duals[:self.n_res], 0.0) * self.unit / self.capacity
        alpha = np.maximum(duals[self.n_res + self.blocks:], 0.0) if self.levels else None
        if alpha is not None:
            alpha = alpha / alpha.sum() if alpha.sum() > 0 else np.full(self.blocks, 1.0 / self.blocks)
        return weights, objective, prices, alpha

    def _linprog(self):
        a = np.zeros((self.rows, self.n_cols))
        cost = np.concatenate([c for c, _, _ in self._columns])
        column = 0
        for c, rows, values in self._columns:
            for r, v in zip(rows, values):
                a[r, column] = v
                column += 1
        lower, upper = self._bounds
        equal = np.isfinite(lower)
        result = linprog(cost, A_ub=a[~equal], b_ub=upper[~equal], A_eq=a[equal], b_eq=upper[equal], bounds=(0, None),
                         method="highs-ds")
        if result.status != 0:
            raise RuntimeError(f"gavel master LP failed: {result.message}")
        duals = np.zeros(self.rows)
        duals[~equal], duals[equal] = -result.ineqlin.marginals, -result.eqlin.marginals
        return result.x, duals


def _price_loop(oracle, s: _Shapes, master: _Master, capacity: np.ndarray, tolerance: float, start: np.ndarray):
    """Cutting planes on ``L`` (Dantzig-Wolfe on the LP) from prices ``start``: ``(weights, lower,
    upper, evaluations, rounds, last prices)``; an evaluation is ``(prices, value per block, hull)``."""
    upper, evaluated, p = np.inf, [], start
    alpha = np.full(s.n_blocks, 1.0 / s.n_blocks)
    weights, lower = None, -np.inf
    best_gap, since = np.inf, 0
    for rounds in range(1, _MAX_ROUNDS + 1):
        e = _Envelopes(s, p)
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
    s = _Shapes(job, gpus, kind, np.asarray(rate, dtype=np.float64), factor, weight, n_rows, np.asarray(shape_of),
                n_types, io, multiplicity)
    if s.rows.size == 0 or not s.t_max > 0 or not np.all(capacity > 0):
        return Solved(np.zeros(job.size), 0.0, 0.0, 0)
    max_min = _MaxMin(s)
    master = _Master(capacity, s.n_blocks, levels=True, unit=s.t_max)
    master.add(np.zeros(s.n_blocks), np.zeros((s.n_blocks, s.resources)))  # idling: keeps every capacity row
    weights, level, bound, evaluated, rounds, prices = _price_loop(max_min, s, master, capacity, tolerance,
                                                                   np.zeros(s.resources))
    fraction = np.zeros(job.size)
    for w, (p, levels, hull) in zip(weights[1:], evaluated):
        if np.any(w > _USED):
            _Envelopes(s, p, hull).fractions(s, max_min.rates(levels), np.where(w > _USED, w, 0.0)[s.block], fraction)
    if not (water_fill and level > 0):
        return Solved(np.clip(fraction, 0.0, 1.0), level, bound, rounds)
    fill = _WaterFill(s, s.demand * level * (1 - _LEVEL_SLACK))
    # The max-min allocation keeps every floor and capacity: each block's first column.
    reached = np.sum(weights * np.array(master.values), axis=0)   # per block
    first = reached * np.bincount(s.block, weights=s.many * s.demand * s.factor, minlength=s.n_blocks)
    second = _Master(capacity, s.n_blocks, levels=False, unit=float(first.sum()))
    second.add(first, np.einsum("ib,ibr->br", weights, np.array(master.uses)))
    # A unit of level is worth sum(many * weight) of the water-filled total (every job at its floor):
    # the max-min prices so converted are where the water-filling ones start.
    start = prices * float(np.sum(s.many * s.factor * s.demand))
    weights2, _, _, evaluated2, rounds2, _ = _price_loop(fill, s, second, capacity, fill_tolerance, start)
    filled = fraction * weights2[0][s.candidate_block]
    for w, (p, _, hull) in zip(weights2[1:], evaluated2):
        if np.any(w > _USED):
            e = _Envelopes(s, p, hull)
            e.fractions(s, fill.rates(e), np.where(w > _USED, w, 0.0)[s.block], filled)
    return Solved(np.clip(filled, 0.0, 1.0), level, bound, rounds + rounds2)
