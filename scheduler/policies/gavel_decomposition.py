"""The parts of :mod:`scheduler.policies.gavel_lp`'s decomposition: the jobs of a round grouped
by shape and dealt into blocks (:class:`Shapes`, :class:`Keys`), each shape's lower convex
envelope of (rate, price) under the current prices (:class:`Envelopes`), and the master LP that
combines the price evaluations (:class:`Master`)."""

from __future__ import annotations

import numpy as np

try:  # HiGHS' own bindings, which scipy >= 1.15 ships
    from scipy.optimize._highspy import _core as _highs
except ImportError:  # older scipy: the master LP through linprog
    _highs = None
from scipy.optimize import linprog

BLOCKS = 64          # the master LP's blocks of jobs, at most


class Shapes:
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
        # shape, or shapes dealt round-robin into BLOCKS blocks.
        self.n_blocks = min(self.n_shapes, BLOCKS)
        self.shape_block = np.arange(self.n_shapes) % self.n_blocks
        self.block = self.shape_block[self.shape]
        self.candidate_block = self.block[np.searchsorted(rows, job)]
        # Jobs by (shape, demand), with running sums: totals over the jobs of a shape in a demand range.
        by_demand = np.lexsort((self.demand, self.shape))
        self.shape_start = np.searchsorted(self.shape[by_demand], np.arange(self.n_shapes + 1))
        self.sum_md = np.concatenate([[0.0], np.cumsum((self.many * self.demand)[by_demand])])
        self.sum_m = np.concatenate([[0.0], np.cumsum(self.many[by_demand])])
        self.demand_keys = Keys(self.shape[by_demand], self.demand[by_demand])

    def candidates(self, row: np.ndarray, column: np.ndarray) -> np.ndarray:
        """Candidate index of column ``column`` of job ``row`` (positions among the active rows)."""
        return self.order[self.first_candidate[row] + self.position[self.shape[row], column]]


class Keys:
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


class Envelopes:
    """Every shape's envelope at prices ``p``: per vertex its rate, cost and what it uses (gpus of a
    type, io), per segment its slope (cost per unit of rate)."""

    def __init__(self, s: Shapes, p: np.ndarray, hull: tuple[np.ndarray, np.ndarray] | None = None):
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

    def use(self, s: Shapes, weight: np.ndarray) -> np.ndarray:
        """Per block: what the vertices use, ``weight`` (shape x vertex) times each: block x resource."""
        block = np.broadcast_to(s.shape_block[:, None], weight.shape)
        out = np.bincount((block * s.resources + self.kind).ravel(), weights=(weight * self.gpus).ravel(),
                          minlength=s.n_blocks * s.resources).reshape(s.n_blocks, s.resources)
        if self.io is not None:
            out[:, self.n_types] += np.bincount(block.ravel(), weights=(weight * self.io).ravel(), minlength=s.n_blocks)
        return out

    def positions(self, s: Shapes, rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per job at ``rate`` on its envelope: its segment (1-based, ``(start, end]`` holds the
        rate) and the share of the segment's end vertex in its mixture."""
        vertices = self.rate.shape[1]
        keys = Keys(np.repeat(np.arange(s.n_shapes), vertices), self.rate.ravel(), rate)
        below = keys.count(s.shape, rate, side="left") - s.shape * vertices
        segment = np.clip(below, 1, vertices - 1)
        start = self.rate[s.shape, segment - 1]
        run = self.run[s.shape, segment - 1]
        share = np.clip((rate - start) / np.where(run > 0, run, 1.0), 0.0, 1.0)
        return segment, np.where(run > 0, share, 1.0) * (rate > 0)

    def fractions(self, s: Shapes, rate: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        """Adds to ``out`` (per candidate) ``weight`` (per job) times its time share when every job
        runs at ``rate`` on its envelope (jobs of weight 0 skipped)."""
        row = np.flatnonzero(weight > 0)
        segment, share = self.positions(s, rate)
        segment, share, weight = segment[row], share[row], weight[row]
        shape = s.shape[row]
        for vertex, amount in ((self.vertex[shape, segment - 1], 1.0 - share), (self.vertex[shape, segment], share)):
            used = (vertex >= 0) & (amount > 0)
            np.add.at(out, s.candidates(row[used], vertex[used]), (weight * amount)[used])


class Master:
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
