"""Step and sync time at any (nodes, replicas, local_bsz) from measured job shapes.

A *shape* is ``(nodes, replicas)``; the profile measures some shapes at some per-GPU batch
sizes. Lookups are exact at measured points and piecewise linear between them:

1. **local_bsz**, within one measured shape: linear between the measured batch sizes (step
   time is close to linear in the batch, which is also what the Pollux model assumes).
2. **replicas**, at a measured node count: linear between the nearest measured replica
   counts (both evaluated at the same batch size).
3. **nodes**: linear between the two nearest measured node counts, each evaluated at the
   query's replicas and batch size.

Outside the measured range of any axis (a batch larger than a shape was measured with,
more replicas than measured on that many nodes, more nodes than the profile has), the
value at the nearest measured point is scaled by the ratio the Pollux step-time model
(fitted to the same profile) predicts between the query and that point. Extrapolation thus
follows the model's shape (compute linear in the batch, sync linear in the replicas) while
staying anchored to data, and stays positive.

Everything is precomputed on a dense grid (measured node counts x replicas 1..max x
measured batch sizes), so a query is a trilinear gather plus the model ratio: vectorized
over any number of points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator.goodput import PerfParams, step_time, sync_time


@dataclass(frozen=True)
class ShapeMeasurements:
    """Measurements of one ``(nodes, replicas)`` shape, sorted by batch size."""

    local_bsz: np.ndarray
    step_time: np.ndarray  # seconds
    sync_time: np.ndarray  # seconds


def _model_times(model: PerfParams, nodes, replicas, local_bsz) -> tuple[np.ndarray, np.ndarray]:
    return step_time(model, nodes, replicas, local_bsz), sync_time(model, nodes, replicas)


def _safe_ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), 1.0)


class ShapeTable:
    """Dense interpolation grid over (node count, replicas, local batch size) for one application."""

    def __init__(self, shapes: dict[tuple[int, int], ShapeMeasurements], model: PerfParams):
        if not shapes:
            raise ValueError("no measured shapes")
        self._model = model
        self.node_counts = np.array(sorted({n for n, _ in shapes}), dtype=np.float64)
        self.max_replicas = max(r for _, r in shapes)
        self.batch_sizes = np.array(sorted({float(b) for m in shapes.values() for b in m.local_bsz}))
        self._step, self._sync = self._build(shapes)

    # --- construction ---------------------------------------------------------------------

    def _extrapolate(self, values_step, values_sync, anchor, target):
        """Scale measured values at ``anchor`` (n, r, b) to ``target`` by the model's ratio."""
        step_a, sync_a = _model_times(self._model, *anchor)
        step_t, sync_t = _model_times(self._model, *target)
        return values_step * _safe_ratio(step_t, step_a), values_sync * _safe_ratio(sync_t, sync_a)

    def _curve(self, nodes: int, replicas: int, m: ShapeMeasurements) -> tuple[np.ndarray, np.ndarray]:
        """One shape's step and sync time on the common batch-size grid."""
        grid = self.batch_sizes
        anchor_bsz = np.clip(grid, m.local_bsz[0], m.local_bsz[-1])
        step = np.interp(anchor_bsz, m.local_bsz, m.step_time)
        sync = np.interp(anchor_bsz, m.local_bsz, m.sync_time)
        return self._extrapolate(step, sync, (nodes, replicas, anchor_bsz), (nodes, replicas, grid))

    def _build(self, shapes):
        grid_b = self.batch_sizes
        shape = (len(self.node_counts), self.max_replicas + 1, len(grid_b))
        step = np.full(shape, np.nan)
        sync = np.full(shape, np.nan)
        for i, nodes in enumerate(self.node_counts.astype(int)):
            measured = sorted(r for n, r in shapes if n == nodes)
            curves = {r: self._curve(nodes, r, shapes[(nodes, r)]) for r in measured}
            for replicas in range(1, self.max_replicas + 1):
                if replicas in curves:
                    step[i, replicas], sync[i, replicas] = curves[replicas]
                elif measured[0] < replicas < measured[-1]:
                    upper = next(r for r in measured if r > replicas)
                    lower = max(r for r in measured if r < replicas)
                    w = (replicas - lower) / (upper - lower)
                    step[i, replicas] = (1 - w) * curves[lower][0] + w * curves[upper][0]
                    sync[i, replicas] = (1 - w) * curves[lower][1] + w * curves[upper][1]
                else:
                    anchor = min(max(replicas, measured[0]), measured[-1])
                    step[i, replicas], sync[i, replicas] = self._extrapolate(
                        *curves[anchor], (nodes, anchor, grid_b), (nodes, replicas, grid_b)
                    )
        step[:, 0] = step[:, 1]  # never read: replicas >= 1; keeps the grid NaN-free
        sync[:, 0] = sync[:, 1]
        return step, sync

    # --- queries --------------------------------------------------------------------------

    @staticmethod
    def _bracket(grid: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lower index and weight of the upper neighbour for linear interpolation on ``grid``."""
        if len(grid) == 1:
            return np.zeros(x.shape, dtype=np.intp), np.zeros(x.shape)
        i = np.clip(np.searchsorted(grid, x, side="right") - 1, 0, len(grid) - 2)
        return i, (x - grid[i]) / (grid[i + 1] - grid[i])

    def lookup(self, nodes, replicas, local_bsz) -> tuple[np.ndarray, np.ndarray]:
        """``(step_time, sync_time)`` in seconds; inputs broadcast, already validated."""
        n, r, b = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (nodes, replicas, local_bsz)))
        n_in = np.clip(n, self.node_counts[0], self.node_counts[-1])
        r_in = np.clip(r, 1.0, float(self.max_replicas))
        b_in = np.clip(b, self.batch_sizes[0], self.batch_sizes[-1])
        i, wn = self._bracket(self.node_counts, n_in)
        i_hi = np.minimum(i + 1, len(self.node_counts) - 1)
        r_lo = np.clip(np.floor(r_in).astype(np.intp), 1, max(self.max_replicas - 1, 1))
        r_hi = np.minimum(r_lo + 1, self.max_replicas)
        wr = np.clip(r_in - r_lo, 0.0, 1.0)
        j, wb = self._bracket(self.batch_sizes, b_in)
        j_hi = np.minimum(j + 1, len(self.batch_sizes) - 1)

        def gather(grid: np.ndarray) -> np.ndarray:
            def at(ni, ri):
                return (1 - wb) * grid[ni, ri, j] + wb * grid[ni, ri, j_hi]

            def over_replicas(ni):
                return (1 - wr) * at(ni, r_lo) + wr * at(ni, r_hi)

            return (1 - wn) * over_replicas(i) + wn * over_replicas(i_hi)

        step, sync = gather(self._step), gather(self._sync)
        clamped = (n_in != n) | (r_in != r) | (b_in != b)
        if clamped.any():
            step, sync = self._extrapolate(step, sync, (n_in, r_in, b_in), (n, r, b))
        return step, sync
