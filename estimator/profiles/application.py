"""Per-application performance profiles from the Pollux artifact traces.

An :class:`ApplicationProfile` answers "how long does a step take" for an application from
its measurements (``placements.csv``, ``scalability.csv``; see :mod:`.interpolation` for how
unmeasured points are filled), "how noisy are its gradients" from ``validation-*.csv``, and
"how much data does it read" from ``datasets.csv``. The simulator uses it as ground truth;
the estimator starts every job of the application from the Pollux model fitted to it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from estimator.fitting import fit_perf_params
from estimator.goodput import BatchBounds, GradParams, PerfParams, split_local_batch
from estimator.profiles import loading
from estimator.profiles.interpolation import ShapeMeasurements, ShapeTable

# Training length per application in the Pollux evaluation workloads (DESIGN.md).
MAX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
# The artifact caps yolov3 at 8 samples per GPU although it measured up to 16.
MAX_LOCAL_BSZ_OVERRIDE = {"yolov3": 8}


def normalize_placement(placement: str | Sequence[int]) -> str:
    """Canonical placement string: per-node GPU counts, empty nodes dropped, smallest rotation.

    Gradients travel around a ring, so rotations of a placement are the same job; the
    traces record each ring once, as its lexicographically smallest rotation (as the
    artifact's simulator does). Counts above 9 per node cannot be written in this format.
    """
    counts = [int(c) for c in placement] if not isinstance(placement, str) else [int(c) for c in placement.strip()]
    counts = [c for c in counts if c > 0]
    if not counts or any(c > 9 for c in counts):
        raise ValueError(f"placement must list 1..9 GPUs per node, got {placement!r}")
    rotations = [counts[i:] + counts[:i] for i in range(len(counts))]
    return "".join(map(str, min(rotations)))


@dataclass(frozen=True)
class Measurement:
    """All measured points of a profile, one entry per CSV row (placements rows, then scalability rows)."""

    placement: tuple[str | None, ...]  # placement string, None for scalability rows
    nodes: np.ndarray
    replicas: np.ndarray
    local_bsz: np.ndarray  # samples per GPU
    step_time: np.ndarray  # seconds
    sync_time: np.ndarray  # seconds


class ApplicationProfile:
    """Measured performance, gradient statistics and dataset facts of one application."""

    def __init__(self, name: str):
        self.name = name
        self.dataset = loading.dataset_for(name)
        self.max_epochs = MAX_EPOCHS.get(name)
        self._placements = loading.read_placements(name)
        self._scalability = loading.read_scalability(name)
        self.validation = loading.read_validation(name)
        self.measurements = self._all_measurements()
        self.bounds = BatchBounds(
            init_batch_size=min(self.validation),
            max_batch_size=max(self.validation),
            min_local_bsz=int(self._placements.local_bsz.min()),
            max_local_bsz=MAX_LOCAL_BSZ_OVERRIDE.get(name, int(self._placements.local_bsz.max())),
        )
        m = self.measurements
        # The profile's own Pollux fit: initial parameters of every job of this application,
        # and the shape used to extrapolate beyond the measurements.
        self.perf_params: PerfParams = fit_perf_params(m.nodes, m.replicas, m.local_bsz, 0, m.step_time, m.sync_time)
        self._table = ShapeTable(self._shapes(), self.perf_params)
        self._by_placement = self._placement_curves()

    # --- data -----------------------------------------------------------------------------

    def _all_measurements(self) -> Measurement:
        p, s = self._placements, self._scalability
        nodes = np.array([len(pl) for pl in p.placement], dtype=np.float64)
        replicas = np.array([sum(map(int, pl)) for pl in p.placement], dtype=np.float64)
        return Measurement(
            placement=p.placement + (None,) * len(s.num_nodes),
            nodes=np.concatenate([nodes, s.num_nodes]),
            replicas=np.concatenate([replicas, s.num_replicas]),
            local_bsz=np.concatenate([p.local_bsz, s.local_bsz]),
            step_time=np.concatenate([p.step_time, s.step_time]),
            sync_time=np.concatenate([p.sync_time, s.sync_time]),
        )

    def _shapes(self) -> dict[tuple[int, int], ShapeMeasurements]:
        """Mean step/sync time per (nodes, replicas, local_bsz): placements of equal shape pool."""
        m = self.measurements
        sums: dict[tuple[int, int], dict[float, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
        for n, r, b, st, sy in zip(m.nodes, m.replicas, m.local_bsz, m.step_time, m.sync_time):
            acc = sums[(int(n), int(r))][float(b)]
            acc[0] += 1
            acc[1] += st
            acc[2] += sy
        shapes = {}
        for key, by_bsz in sums.items():
            bsz = np.array(sorted(by_bsz))
            shapes[key] = ShapeMeasurements(
                local_bsz=bsz,
                step_time=np.array([by_bsz[b][1] / by_bsz[b][0] for b in bsz]),
                sync_time=np.array([by_bsz[b][2] / by_bsz[b][0] for b in bsz]),
            )
        return shapes

    def _placement_curves(self) -> dict[str, ShapeMeasurements]:
        p = self._placements
        curves = {}
        for placement in set(p.placement):
            rows = np.array([pl == placement for pl in p.placement])
            order = np.argsort(p.local_bsz[rows])
            curves[placement] = ShapeMeasurements(p.local_bsz[rows][order], p.step_time[rows][order], p.sync_time[rows][order])
        return curves

    # --- step times -----------------------------------------------------------------------

    @staticmethod
    def _validated(num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike):
        n, r, b = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (num_nodes, num_replicas, local_bsz)))
        if not (np.all(n >= 1) and np.all(r >= n) and np.all(b > 0)):
            raise ValueError("need num_nodes >= 1, num_replicas >= num_nodes and local_bsz > 0")
        return n, r, b

    def step_and_sync_time(self, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Seconds per optimizer step and of synchronisation within it (no accumulation).

        Exact at measured ``(nodes, replicas, local_bsz)`` points, where placements of the
        same shape are averaged; interpolated elsewhere (:mod:`.interpolation`).
        """
        return self._table.lookup(*self._validated(num_nodes, num_replicas, local_bsz))

    def step_time(self, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike) -> np.ndarray:
        """Seconds per optimizer step with ``local_bsz`` samples per GPU (see :meth:`step_and_sync_time`)."""
        return self.step_and_sync_time(num_nodes, num_replicas, local_bsz)[0]

    def sync_time(self, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike) -> np.ndarray:
        """Seconds of gradient synchronisation per step (see :meth:`step_and_sync_time`)."""
        return self.step_and_sync_time(num_nodes, num_replicas, local_bsz)[1]

    def placement_step_and_sync_time(self, placement: str | Sequence[int], local_bsz: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`step_and_sync_time` for one exact placement, e.g. ``"1444"`` or ``(4, 4, 4, 1)``.

        A measured placement is interpolated along its own batch sizes (exact at its rows);
        beyond them, and for unmeasured placements, the shape lookup applies.
        """
        key = normalize_placement(placement)
        nodes, replicas = len(key), sum(map(int, key))
        b = np.asarray(local_bsz, dtype=np.float64)
        step, sync = self.step_and_sync_time(nodes, replicas, b)
        curve = self._by_placement.get(key)
        if curve is None:
            return step, sync
        inside = (b >= curve.local_bsz[0]) & (b <= curve.local_bsz[-1])
        return (
            np.where(inside, np.interp(b, curve.local_bsz, curve.step_time), step),
            np.where(inside, np.interp(b, curve.local_bsz, curve.sync_time), sync),
        )

    def throughput(self, gpus: ArrayLike, nodes: ArrayLike, global_bsz: ArrayLike) -> np.ndarray:
        """Compute-bound samples/s of ``gpus`` GPUs on ``nodes`` nodes at a global batch size.

        The batch is spread evenly (``ceil(global_bsz / gpus)`` per GPU); a per-GPU batch
        above ``max_local_bsz`` is processed as several accumulated micro-batches, each
        costing the step time minus the synchronisation. The rate counts the samples
        actually processed, ``gpus * atomic * (accum + 1)``.
        """
        g, n, batch = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (gpus, nodes, global_bsz)))
        atomic, accum = split_local_batch(batch / np.maximum(g, 1.0), self.bounds.max_local_bsz)
        step, sync = self.step_and_sync_time(n, g, atomic)
        total = step + accum * (step - sync)
        return g * atomic * (accum + 1.0) / total

    # --- gradient statistics --------------------------------------------------------------

    def grad_params(self, batch_size: float, epoch: int) -> GradParams:
        """Gradient statistics in ``epoch`` at ``batch_size``, linear between validated batch sizes.

        As in the artifact's simulator; batch sizes outside the validated range take the
        nearest run, epochs past a run's end its last epoch.
        """
        sizes = np.array(list(self.validation), dtype=np.float64)
        sqr = [t.grad_sqr[min(epoch, len(t.grad_sqr) - 1)] for t in self.validation.values()]
        var = [t.grad_var[min(epoch, len(t.grad_var) - 1)] for t in self.validation.values()]
        return GradParams(float(np.interp(batch_size, sizes, sqr)), float(np.interp(batch_size, sizes, var)))

    def typical_grad_params(self) -> GradParams:
        """Statistics of the epoch with the median noise scale in the run at the initial batch size.

        Jobs start from this before they report their own: noise grows over training
        (early epochs understate it, late ones overstate it), and the median epoch is a
        middle ground that no single outlier epoch can move.
        """
        trace = self.validation[self.bounds.init_batch_size]
        ratio = trace.grad_var / np.maximum(trace.grad_sqr, 1e-300)
        epoch = int(np.argsort(ratio)[(len(ratio) - 1) // 2])
        return GradParams(float(trace.grad_sqr[epoch]), float(trace.grad_var[epoch]))


@functools.lru_cache(maxsize=None)
def load_profile(name: str) -> ApplicationProfile:
    """The packaged profile of ``name`` (cached); ``KeyError`` for an unknown application."""
    if name not in loading.application_names():
        raise KeyError(f"no profile for application {name!r}; known: {', '.join(loading.application_names())}")
    return ApplicationProfile(name)
