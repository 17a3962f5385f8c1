"""The Pollux goodput model: step time of data-parallel SGD and statistical efficiency.

Reference: Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
Learning", OSDI'21 (the public implementation is AdaptDL's ``goodput.py``; this is an
independent, vectorized implementation of the same model).

Step time (seconds). A job runs ``replicas`` GPUs over ``nodes`` nodes; each GPU processes
``atomic_bsz`` samples per micro-batch and accumulates ``accum_steps`` extra micro-batches
before every synchronised optimizer step, so the global batch is
``replicas * atomic_bsz * (accum_steps + 1)`` samples::

    T_grad = alpha_c + beta_c * atomic_bsz                  compute of one micro-batch
    T_sync = 0                                               one replica
           = alpha_r + beta_r * (replicas - 2)               all replicas on one node
           = alpha_n + beta_n * (replicas - 2)               replicas on several nodes
    T_step = accum_steps * T_grad + (T_grad**gamma + T_sync**gamma) ** (1 / gamma)

``gamma`` in [1, 10] says how much synchronisation overlaps the backward pass: 1 adds the
two, large values approach ``max``. Replica counts below 2 add no retrogression (the
``replicas - 2`` term is floored at 0).

Statistical efficiency. With gradient statistics ``grad_sqr`` (squared norm of the true
gradient) and ``grad_var`` (gradient variance), both expressed at the initial batch size
``B0``, the gradient noise scale is ``B_noise = B0 * grad_var / grad_sqr`` and training at
batch ``B`` makes, per sample, this fraction of the progress it makes at ``B0``::

    E(B) = (B_noise + B0) / (B_noise + B) = (var + sqr) / (var + sqr * B / B0)
         = 1 / (1 + sqr / (sqr + var) * (B / B0 - 1))

``E(B0) = 1`` and ``E`` falls as ``B`` grows. Without noise (``var = 0``) it is ``B0 / B``;
with both statistics 0 (nothing known) we keep Pollux's convention ``B0 / B``. Batches
smaller than ``B0`` are credited 1, never more.

Goodput (samples/s of useful progress) = throughput x efficiency; :func:`best_batch` picks
the batch size (and accumulation steps) maximizing it, optionally under an IO cap on
throughput (the SiloD ``min(T(g), R_io)``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

# Tolerance for ceil() on ratios that are integers up to rounding error.
_CEIL_EPS = 1e-8


class PerfParams(NamedTuple):
    """Pollux step-time model parameters (see module docstring)."""

    alpha_c: float  # s: constant compute time per micro-batch
    beta_c: float  # s/sample: compute time per sample of a micro-batch
    alpha_n: float  # s: sync time of a 2-replica job spanning nodes
    beta_n: float  # s/replica: extra inter-node sync time per replica beyond 2
    alpha_r: float  # s: sync time of a 2-replica job within one node
    beta_r: float  # s/replica: extra intra-node sync time per replica beyond 2
    gamma: float  # dimensionless, in [1, 10]: overlap of compute and sync


class GradParams(NamedTuple):
    """Gradient statistics at the initial batch size (squared gradient-norm units)."""

    sqr: float  # |E[g]|^2
    var: float  # trace of Var[g]


def compute_time(perf: PerfParams, atomic_bsz: ArrayLike) -> np.ndarray:
    """Seconds of forward/backward for one micro-batch of ``atomic_bsz`` samples per GPU."""
    return perf.alpha_c + perf.beta_c * np.asarray(atomic_bsz, dtype=np.float64)


def sync_time(perf: PerfParams, nodes: ArrayLike, replicas: ArrayLike) -> np.ndarray:
    """Seconds of gradient all-reduce per optimizer step (0 for a single replica)."""
    nodes = np.asarray(nodes, dtype=np.float64)
    replicas = np.asarray(replicas, dtype=np.float64)
    extra = np.maximum(replicas - 2.0, 0.0)
    across_nodes = perf.alpha_n + perf.beta_n * extra
    within_node = perf.alpha_r + perf.beta_r * extra
    return np.where(replicas > 1, np.where(nodes > 1, across_nodes, within_node), 0.0)


def step_time(
    perf: PerfParams, nodes: ArrayLike, replicas: ArrayLike, atomic_bsz: ArrayLike, accum_steps: ArrayLike = 0
) -> np.ndarray:
    """Seconds per optimizer step, including ``accum_steps`` accumulation micro-batches."""
    grad = compute_time(perf, atomic_bsz)
    sync = sync_time(perf, nodes, replicas)
    gamma = np.asarray(perf.gamma, dtype=np.float64)
    # (a^g + b^g)^(1/g) = hi * (1 + (lo/hi)^g)^(1/g): no overflow for gamma up to 10, and
    # two powers instead of three (this is the hot loop of the batch-size search).
    high = np.maximum(np.maximum(grad, sync), 1e-300)
    overlapped = high * (1.0 + (np.minimum(grad, sync) / high) ** gamma) ** (1.0 / gamma)
    return np.asarray(accum_steps, dtype=np.float64) * grad + overlapped


def throughput(
    perf: PerfParams, nodes: ArrayLike, replicas: ArrayLike, atomic_bsz: ArrayLike, accum_steps: ArrayLike = 0
) -> np.ndarray:
    """Samples/s: global batch ``replicas * atomic_bsz * (accum_steps + 1)`` over the step time."""
    replicas = np.asarray(replicas, dtype=np.float64)
    accum = np.asarray(accum_steps, dtype=np.float64)
    batch = replicas * np.asarray(atomic_bsz, dtype=np.float64) * (accum + 1.0)
    return batch / step_time(perf, nodes, replicas, atomic_bsz, accum)


def efficiency(grad: GradParams, init_batch_size: float, batch_size: ArrayLike) -> np.ndarray:
    """Statistical efficiency ``E(B)`` in (0, 1] relative to ``init_batch_size`` (module docstring)."""
    ratio = np.maximum(np.asarray(batch_size, dtype=np.float64) / init_batch_size, 1.0)
    return 1.0 / (1.0 + _signal_share(grad) * (ratio - 1.0))


def _signal_share(grad: GradParams) -> np.ndarray:
    """``sqr / (sqr + var)``, so that ``E = 1 / (1 + share * (B/B0 - 1))``; 1 when both are 0."""
    sqr = np.asarray(grad.sqr, dtype=np.float64)
    total = sqr + np.asarray(grad.var, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, sqr / np.where(total > 0, total, 1.0), 1.0)


def noise_scale(grad: GradParams, init_batch_size: float) -> float:
    """Gradient noise scale ``B0 * var / sqr`` in samples (inf when ``sqr = 0``)."""
    return float(init_batch_size * grad.var / grad.sqr) if grad.sqr > 0 else float("inf")


def split_local_batch(local_bsz: ArrayLike, max_local_bsz: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Split a per-GPU batch into ``(atomic_bsz, accum_steps)`` with ``atomic_bsz <= max_local_bsz``.

    ``accum_steps = ceil(local / max) - 1`` extra micro-batches and
    ``atomic_bsz = ceil(local / (accum_steps + 1))``, so ``atomic_bsz * (accum_steps + 1)``
    is ``local_bsz`` rounded up to what the GPUs actually process.
    """
    local = np.asarray(local_bsz, dtype=np.float64)
    accum = np.maximum(np.ceil(local / np.asarray(max_local_bsz, dtype=np.float64) - _CEIL_EPS) - 1.0, 0.0)
    atomic = np.maximum(np.ceil(local / (accum + 1.0) - _CEIL_EPS), 1.0)
    return atomic, accum


def goodput(
    perf: PerfParams,
    grad: GradParams,
    init_batch_size: float,
    nodes: ArrayLike,
    replicas: ArrayLike,
    atomic_bsz: ArrayLike,
    accum_steps: ArrayLike = 0,
    io_cap_samples_per_s: ArrayLike = np.inf,
) -> np.ndarray:
    """Goodput (samples/s) = ``min(throughput, io_cap)`` x efficiency at the processed batch."""
    replicas = np.asarray(replicas, dtype=np.float64)
    accum = np.asarray(accum_steps, dtype=np.float64)
    batch = replicas * np.asarray(atomic_bsz, dtype=np.float64) * (accum + 1.0)
    rate = np.minimum(throughput(perf, nodes, replicas, atomic_bsz, accum), io_cap_samples_per_s)
    return rate * efficiency(grad, init_batch_size, batch)


class BatchBounds(NamedTuple):
    """Limits on batch sizes, in samples."""

    init_batch_size: int  # B0: smallest global batch; efficiency is 1 here
    max_batch_size: int  # largest global batch the job accepts
    min_local_bsz: int  # smallest per-GPU micro-batch worth running
    max_local_bsz: int  # largest per-GPU micro-batch that fits in GPU memory


class BestBatch(NamedTuple):
    """Result of :func:`best_batch`, arrays shaped like the broadcast inputs."""

    goodput: np.ndarray  # samples/s
    batch_size: np.ndarray  # global samples per optimizer step actually processed
    atomic_bsz: np.ndarray  # samples per GPU micro-batch
    accum_steps: np.ndarray  # extra micro-batches per optimizer step


# Candidate global batch sizes: a geometric grid, then a finer grid between the neighbours of
# the best coarse point. Tests check the result against a brute-force integer search.
_COARSE_POINTS = 24
_FINE_POINTS = 16


def _per_group(value, size: int, index: np.ndarray) -> np.ndarray:
    """Column vector of a scalar-or-per-group parameter for the groups in ``index``."""
    return np.broadcast_to(np.asarray(value, dtype=np.float64), (size,))[index][:, None]


def _evaluate_grid(perf, grad, bounds, nodes, replicas, size, index, batch_grid):
    """Throughput and efficiency of groups ``index`` at global batch sizes ``batch_grid`` (rows x points).

    Returns ``(samples_per_s, efficiency, processed_batch)``. Same arithmetic as
    :func:`split_local_batch`, :func:`throughput` and :func:`efficiency`, fused with in-place
    operations: this is the scheduler's hot loop and fresh temporaries of this size cost
    more than the arithmetic. Tests hold the two paths equal.
    """
    column = lambda v: _per_group(v, size, index)  # noqa: E731 - local shorthand
    replicas_c = column(replicas)
    sync = sync_time(PerfParams(*(column(v) for v in perf)), column(nodes), replicas_c)
    gamma = column(perf.gamma)

    local = batch_grid / replicas_c
    accum = local / column(bounds.max_local_bsz)
    accum -= _CEIL_EPS
    np.ceil(accum, out=accum)
    accum -= 1.0
    np.maximum(accum, 0.0, out=accum)
    atomic = accum + 1.0
    np.divide(local, atomic, out=atomic)
    atomic -= _CEIL_EPS
    np.ceil(atomic, out=atomic)
    np.maximum(atomic, 1.0, out=atomic)

    grad_time = atomic * column(perf.beta_c)
    grad_time += column(perf.alpha_c)
    high = np.maximum(grad_time, sync)
    np.maximum(high, 1e-300, out=high)
    overlap = np.minimum(grad_time, sync, out=local)
    overlap /= high
    overlap **= gamma
    overlap += 1.0
    overlap **= 1.0 / gamma
    overlap *= high
    step = np.multiply(accum, grad_time, out=high)
    step += overlap

    processed = accum
    processed += 1.0
    processed *= atomic
    processed *= replicas_c
    rate = np.divide(processed, step, out=grad_time)

    eff = np.divide(processed, column(bounds.init_batch_size), out=overlap)
    np.maximum(eff, 1.0, out=eff)
    eff -= 1.0
    eff *= _signal_share(GradParams(column(grad.sqr), column(grad.var)))
    eff += 1.0
    np.reciprocal(eff, out=eff)
    return rate, eff, processed


def candidate_batch_sizes(bounds: BatchBounds, replicas: ArrayLike, points: int = _COARSE_POINTS) -> np.ndarray:
    """Geometric grid of global batch sizes, shape ``(len(replicas), points)``.

    From ``max(B0, replicas * min_local_bsz)`` to ``max_batch_size``. When even the smallest
    local batch exceeds ``max_batch_size`` every GPU still gets ``min_local_bsz`` samples
    (the bound on the GPU wins over the bound on the batch). Bound fields may be arrays
    shaped like ``replicas``.
    """
    replicas = np.atleast_1d(np.asarray(replicas, dtype=np.float64))
    low = np.maximum(np.asarray(bounds.init_batch_size, dtype=np.float64), replicas * np.asarray(bounds.min_local_bsz, dtype=np.float64))
    high = np.maximum(low, np.asarray(bounds.max_batch_size, dtype=np.float64))
    steps = np.linspace(0.0, 1.0, points)
    return np.exp(np.log(low)[:, None] + np.log(high / low)[:, None] * steps[None, :])


def best_batch_grouped(
    perf: PerfParams,
    grad: GradParams,
    bounds: BatchBounds,
    nodes: ArrayLike,
    replicas: ArrayLike,
    group: np.ndarray,
    io_cap_samples_per_s: ArrayLike = np.inf,
) -> BestBatch:
    """:func:`best_batch` for queries that share jobs and shapes.

    ``perf``, ``grad``, ``bounds`` fields, ``nodes`` and ``replicas`` describe G groups
    (scalars or arrays of length G); query k belongs to group ``group[k]`` and has IO cap
    ``io_cap_samples_per_s[k]``. The expensive part (step times on the batch grid) runs once
    per group (and per group and coarse optimum for the fine grid); each query then only
    takes a minimum and an argmax. Returns arrays of length K.
    """
    group = np.asarray(group, dtype=np.intp)
    size = int(group.max()) + 1 if group.size else 0
    cap = np.broadcast_to(np.asarray(io_cap_samples_per_s, dtype=np.float64), group.shape)[:, None]
    groups = np.arange(size)
    replicas_g = np.broadcast_to(np.asarray(replicas, dtype=np.float64), (size,))
    bounds_g = BatchBounds(*(np.broadcast_to(np.asarray(v, dtype=np.float64), (size,)) for v in bounds))
    coarse = candidate_batch_sizes(bounds_g, replicas_g)
    rate, eff, _ = _evaluate_grid(perf, grad, bounds, nodes, replicas, size, groups, coarse)
    best = np.argmax(np.minimum(rate[group], cap) * eff[group], axis=1)

    # Fine grid per distinct (group, coarse optimum): queries agreeing on both share it.
    points = coarse.shape[1]
    fine_keys, fine_of_query = np.unique(group * points + best, return_inverse=True)
    fine_group, fine_best = np.divmod(fine_keys, points)
    lower = coarse[fine_group, np.maximum(fine_best - 1, 0)]
    upper = coarse[fine_group, np.minimum(fine_best + 1, points - 1)]
    fine = lower[:, None] * (upper / lower)[:, None] ** np.linspace(0.0, 1.0, _FINE_POINTS)[None, :]
    rate, eff, processed = _evaluate_grid(perf, grad, bounds, nodes, replicas, size, fine_group, fine)
    value = np.minimum(rate[fine_of_query], cap) * eff[fine_of_query]
    pick = np.argmax(value, axis=1)
    rows = np.arange(group.size)
    batch = processed[fine_of_query, pick]
    atomic, accum = split_local_batch(fine[fine_of_query, pick] / replicas_g[group], bounds_g.max_local_bsz[group])
    return BestBatch(goodput=value[rows, pick], batch_size=batch, atomic_bsz=atomic, accum_steps=accum)


def best_batch(
    perf: PerfParams,
    grad: GradParams,
    bounds: BatchBounds,
    nodes: ArrayLike,
    replicas: ArrayLike,
    io_cap_samples_per_s: ArrayLike = np.inf,
) -> BestBatch:
    """Global batch size (and its split) maximizing goodput for each (nodes, replicas).

    Searches batch sizes between ``max(B0, replicas * min_local_bsz)`` and
    ``max_batch_size``; per-GPU batches above ``max_local_bsz`` use gradient accumulation.
    ``io_cap_samples_per_s`` caps throughput (SiloD: an IO-bound job gains nothing from a
    larger batch, so its best batch is smaller). Inputs broadcast; ``replicas >= 1``.
    """
    nodes_b, replicas_b, cap_b = np.broadcast_arrays(
        np.asarray(nodes, dtype=np.float64),
        np.asarray(replicas, dtype=np.float64),
        np.asarray(io_cap_samples_per_s, dtype=np.float64),
    )
    shape = nodes_b.shape
    result = best_batch_grouped(perf, grad, bounds, nodes_b.ravel(), replicas_b.ravel(), np.arange(nodes_b.size), cap_b.ravel())
    return BestBatch(*(field.reshape(shape) for field in result))


def speedup(
    perf: PerfParams,
    grad: GradParams,
    bounds: BatchBounds,
    nodes: ArrayLike,
    replicas: ArrayLike,
    io_cap_samples_per_s: ArrayLike = np.inf,
    base_nodes: int = 1,
    base_replicas: int = 1,
) -> np.ndarray:
    """Best goodput at (nodes, replicas) over best goodput at the base allocation (Pollux: 1 GPU).

    Both at their own best batch size; the base is not IO-capped, so an IO cap shows up as
    lost speedup.
    """
    base = best_batch(perf, grad, bounds, base_nodes, base_replicas).goodput
    return best_batch(perf, grad, bounds, nodes, replicas, io_cap_samples_per_s).goodput / base
