"""Batch prediction: many (job model, candidate allocation) pairs in one vectorized pass.

This is what the estimator service and the scheduler call each round. For every pair it
combines the Pollux model (compute throughput, statistical efficiency, best batch size) with
the SiloD model (hit ratio, IO-bound rate, IO demand, cache efficiency). The fields mirror
``silod.v1.Prediction``:

- ``compute_samples_per_s``  T(g): samples/s on the GPUs if IO were free
- ``io_bound_samples_per_s`` R_io: samples/s the cache + IO grant sustain (inf if no IO needed)
- ``throughput_samples_per_s`` min of the two
- ``statistical_efficiency`` Pollux efficiency at the batch size, 0..1
- ``goodput_samples_per_s``  throughput x efficiency
- ``hit_ratio``              c / d
- ``io_demand_bytes_per_s``  b* = T(g) s (1 - c/d)
- ``cache_efficiency``       T(g) s / d, (bytes/s) per cached byte
- ``batch_size``             global samples per step assumed (the best one when asked for 0)
- ``speedup``                goodput / the job's base goodput

Conventions:

- ``nodes = 0`` means packed: ``ceil(gpus / gpus_per_node)`` nodes.
- ``batch_size = 0`` asks for the goodput-maximizing batch size *given the IO grant*: an
  IO-bound job is better off with a smaller batch (its samples/s are capped anyway, and
  smaller batches are statistically more efficient).
- The base allocation for ``speedup`` is Pollux's: one GPU, its best batch size, IO not
  limiting. A job fed by IO at compute speed on one GPU has speedup 1.
- ``gpus = 0`` (no allocation): compute, throughput, efficiency, goodput, IO demand, cache
  efficiency, batch size and speedup are 0; hit ratio and IO-bound rate still describe the
  cache and IO grant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import ArrayLike

from estimator import silod_model
from estimator.goodput import (
    BatchBounds,
    GradParams,
    PerfParams,
    best_batch_grouped,
    efficiency,
    split_local_batch,
    throughput,
)
from estimator.job_model import JobModel

DEFAULT_GPUS_PER_NODE = 4  # the Pollux testbed and simulator: 16 nodes x 4 GPUs


@dataclass(frozen=True)
class Predictions:
    """One entry per candidate, same order as the inputs (see the module docstring for units)."""

    compute_samples_per_s: np.ndarray
    io_bound_samples_per_s: np.ndarray
    throughput_samples_per_s: np.ndarray
    statistical_efficiency: np.ndarray
    goodput_samples_per_s: np.ndarray
    hit_ratio: np.ndarray
    io_demand_bytes_per_s: np.ndarray
    cache_efficiency: np.ndarray
    batch_size: np.ndarray  # int64
    speedup: np.ndarray

    def __len__(self) -> int:
        return len(self.batch_size)

    def row(self, i: int) -> dict[str, float | int]:
        """Candidate ``i`` as a dict keyed like ``silod.v1.Prediction``'s fields."""
        return {f.name: getattr(self, f.name)[i].item() for f in fields(self)}


class ModelTable:
    """Job models as column arrays, reusable across :func:`predict` calls.

    Building it costs one Python step per model plus each model's base goodput; scheduling
    rounds that evaluate the same jobs repeatedly should build it once.
    """

    def __init__(self, models: Sequence[JobModel]):
        if not models:
            raise ValueError("need at least one job model")
        self.models = tuple(models)
        column = lambda values: np.array(values, dtype=np.float64)  # noqa: E731
        self.perf = PerfParams(*(column(v) for v in zip(*(m.perf for m in self.models))))
        self.grad = GradParams(*(column(v) for v in zip(*(m.grad for m in self.models))))
        self.bounds = BatchBounds(*(column(v) for v in zip(*(m.bounds for m in self.models))))
        self.dataset_bytes = column([m.dataset_bytes for m in self.models])
        self.bytes_per_sample = column([m.bytes_per_sample for m in self.models])
        every = np.arange(len(self.models))
        self.base_goodput = best_batch_grouped(self.perf, self.grad, self.bounds, 1.0, 1.0, every).goodput

    def __len__(self) -> int:
        return len(self.models)

    def take(self, index: np.ndarray) -> tuple[PerfParams, GradParams, BatchBounds]:
        """Parameters of models ``index`` as arrays."""
        return (
            PerfParams(*(f[index] for f in self.perf)),
            GradParams(*(f[index] for f in self.grad)),
            BatchBounds(*(f[index] for f in self.bounds)),
        )


def _integers(name: str, value: ArrayLike, size: int) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            raise ValueError(f"{name} must hold whole numbers")
    elif array.dtype.kind not in "iub":
        raise ValueError(f"{name} must be numeric")
    array = np.broadcast_to(array.astype(np.int64), (size,))
    if np.any(array < 0):
        raise ValueError(f"{name} must be non-negative, got {array[array < 0][0]}")
    return array


def _floats(name: str, value: ArrayLike, size: int) -> np.ndarray:
    array = np.broadcast_to(np.asarray(value, dtype=np.float64), (size,))
    bad = ~(array >= 0)  # catches NaN
    if bad.any():
        raise ValueError(f"{name} must be a non-negative number, got {array[bad][0]}")
    return array


def predict(
    models: ModelTable | Sequence[JobModel],
    model_index: ArrayLike,
    gpus: ArrayLike,
    nodes: ArrayLike,
    cache_bytes: ArrayLike,
    remote_io_bytes_per_s: ArrayLike,
    batch_size: ArrayLike = 0,
    *,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    base_index: ArrayLike | None = None,
) -> Predictions:
    """Predict every candidate ``k``: job ``models[model_index[k]]`` with ``gpus[k]`` GPUs on ``nodes[k]`` nodes,
    ``cache_bytes[k]`` bytes of cache, ``remote_io_bytes_per_s[k]`` bytes/s of remote IO, at global
    ``batch_size[k]`` (0 = best).

    ``speedup`` divides by the base goodput of ``models[base_index[k]]`` (default: the
    candidate's own model); a job's candidates on several GPU types pass its reference model
    there, so their speedups compare across types.

    Array arguments broadcast to one length K. ``ValueError`` (naming the argument) on
    negative values, fractional counts, an unknown model index, ``nodes > gpus`` or
    ``gpus > 0`` with ``nodes`` impossible to fill.
    """
    table = models if isinstance(models, ModelTable) else ModelTable(models)
    size = int(np.broadcast(*(np.asarray(a) for a in (model_index, gpus, nodes, cache_bytes, remote_io_bytes_per_s, batch_size))).size)
    index = _integers("model_index", model_index, size)
    if np.any(index >= len(table)):
        raise ValueError(f"model_index must be below the number of models ({len(table)})")
    base_of = index if base_index is None else _integers("base_index", base_index, size)
    if np.any(base_of >= len(table)):
        raise ValueError(f"base_index must be below the number of models ({len(table)})")
    gpu = _integers("gpus", gpus, size)
    node = _integers("nodes", nodes, size)
    if gpus_per_node < 1:
        raise ValueError("gpus_per_node must be at least 1")
    node = np.where(node == 0, -(-gpu // gpus_per_node), node)
    if np.any(node > gpu):
        raise ValueError("nodes must not exceed gpus (every node of the job holds at least one GPU)")
    cache = _floats("cache_bytes", cache_bytes, size)
    bandwidth = _floats("remote_io_bytes_per_s", remote_io_bytes_per_s, size)
    requested = _integers("batch_size", batch_size, size)

    dataset = table.dataset_bytes[index]
    sample = table.bytes_per_sample[index]
    hit = silod_model.hit_ratio(cache, dataset)
    io_rate = silod_model.io_bound_samples_per_s(bandwidth, cache, dataset, sample)

    compute = np.zeros(size)
    eff = np.zeros(size)
    batch = np.zeros(size)
    explicit = (gpu > 0) & (requested > 0)
    if explicit.any():
        perf, grad, bounds = table.take(index[explicit])
        g = gpu[explicit].astype(np.float64)
        atomic, accum = split_local_batch(requested[explicit] / g, bounds.max_local_bsz)
        compute[explicit] = throughput(perf, node[explicit], g, atomic, accum)
        batch[explicit] = g * atomic * (accum + 1.0)
        eff[explicit] = efficiency(grad, bounds.init_batch_size, batch[explicit])
    search = (gpu > 0) & (requested == 0)
    if search.any():
        compute[search], eff[search], batch[search] = _best_batches(table, index[search], node[search], gpu[search], io_rate[search])

    rate = np.minimum(compute, io_rate)
    good = rate * eff
    base = table.base_goodput[base_of]
    with np.errstate(divide="ignore", invalid="ignore"):
        speedup = np.where(base > 0, good / np.where(base > 0, base, 1.0), 0.0)
    return Predictions(
        compute_samples_per_s=compute,
        io_bound_samples_per_s=io_rate,
        throughput_samples_per_s=rate,
        statistical_efficiency=eff,
        goodput_samples_per_s=good,
        hit_ratio=hit,
        io_demand_bytes_per_s=silod_model.io_demand_bytes_per_s(compute, cache, dataset, sample),
        cache_efficiency=silod_model.cache_efficiency(compute, dataset, sample),
        batch_size=batch.astype(np.int64),
        speedup=speedup,
    )


def _best_batches(table: ModelTable, index: np.ndarray, nodes: np.ndarray, gpus: np.ndarray, io_cap: np.ndarray):
    """``(compute samples/s, efficiency, batch size)`` at each candidate's goodput-maximizing batch.

    Candidates of the same job and shape share the expensive grid evaluation.
    """
    key = (index * (int(nodes.max()) + 1) + nodes) * (int(gpus.max()) + 1) + gpus
    _, first, group = np.unique(key, return_index=True, return_inverse=True)
    perf, grad, bounds = table.take(index[first])
    best = best_batch_grouped(perf, grad, bounds, nodes[first], gpus[first], group, io_cap)
    perf_c, grad_c, bounds_c = table.take(index)
    compute = throughput(perf_c, nodes, gpus, best.atomic_bsz, best.accum_steps)
    return compute, efficiency(grad_c, bounds_c.init_batch_size, best.batch_size), best.batch_size


def predict_one(
    model: JobModel,
    gpus: ArrayLike,
    nodes: ArrayLike = 0,
    cache_bytes: ArrayLike = 0,
    remote_io_bytes_per_s: ArrayLike = 0,
    batch_size: ArrayLike = 0,
    *,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
) -> Predictions:
    """:func:`predict` for candidates of a single job."""
    return predict([model], 0, gpus, nodes, cache_bytes, remote_io_bytes_per_s, batch_size, gpus_per_node=gpus_per_node)
