"""The SiloD IO/cache model: how fast a job runs given its cache bytes and remote IO bandwidth.

Notation for one job (DESIGN.md, "The SiloD model", which this module implements exactly):

==========  ==================================================================  ============
symbol      meaning                                                             unit
==========  ==================================================================  ============
``d``       dataset size                                                        bytes
``c``       cache granted to the job for that dataset                           bytes
``b``       remote-storage IO bandwidth granted                                 bytes/s
``s``       size of one sample as read from remote storage                      bytes
``T(g)``    compute-bound throughput on the job's GPUs (profile or Pollux)      samples/s
==========  ==================================================================  ============

Every epoch reads each sample once, in a fresh random order. A cache that admits samples
until its quota is full and never evicts during the job (SiloD's "uniform" policy, CoorDL's
MinIO) therefore serves a fixed subset, and

- hit ratio                ``h = c / d`` (clipped to [0, 1])
- IO-bound rate            ``R_io = b / (s * (1 - h))`` samples/s, ``inf`` when ``h == 1``
- throughput               ``min(T(g), R_io)`` samples/s
- IO demand                ``b* = T(g) * s * (1 - h)`` bytes/s, the IO needed to run at compute speed
- cache efficiency         ``T(g) * s / d`` (bytes/s of remote IO saved per cached byte)

These are steady-state figures: the first epoch finds the cache cold.

Edge cases (each is tested with hand-computed values):

- ``c = 0``: no hits, ``R_io = b / s`` and ``b* = T(g) * s``.
- ``c >= d``: the whole dataset is cached, no remote IO is needed: ``h = 1``, ``R_io = inf``,
  ``b* = 0``, throughput is ``T(g)``.
- ``b = 0``: the IO-bound rate is 0 (so is throughput) unless the dataset is fully cached.
- ``g = 0``, i.e. ``T(g) = 0``: throughput 0, IO demand 0, cache efficiency 0.
- ``d = 0``: there is no dataset to read; treated as fully cached (``h = 1``, ``R_io = inf``,
  ``b* = 0``) and cache efficiency is 0 because there is nothing to cache.
- ``s = 0``: samples carry no remote bytes, so IO never limits: ``R_io = inf``, ``b* = 0``,
  cache efficiency 0. ``h`` is still ``c / d``.

Cache efficiency does not depend on ``c``: every cached byte (up to ``d``) removes the same
remote traffic, which is why policies hand out cache in decreasing efficiency. Bytes beyond
``d`` save nothing, so grants should be capped at ``d``.

LRU is analysed separately (:func:`lru_hit_ratio`): on this access pattern it keeps far
fewer hits than ``c / d`` once ``c < d``.

All functions accept numpy arrays (broadcast against each other) or plain numbers; with
only scalar inputs they return a Python ``float``. Negative or NaN inputs raise
``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

ArrayOrFloat = np.ndarray | float


def _checked(name: str, value: ArrayLike) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    # `not (x >= 0)` also catches NaN.
    bad = ~(array >= 0)
    if bad.any():
        raise ValueError(f"{name} must be a non-negative number, got {array[bad].flat[0]!r}")
    return array


def _result(array: np.ndarray, *inputs: ArrayLike) -> ArrayOrFloat:
    if all(np.ndim(x) == 0 for x in inputs):
        return float(array)
    return array


def _miss_ratio(cache: np.ndarray, dataset: np.ndarray) -> np.ndarray:
    """1 - h, with d = 0 counted as fully cached."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        fraction_cached = np.where(dataset > 0, cache / np.where(dataset > 0, dataset, 1.0), 1.0)
    return 1.0 - np.clip(fraction_cached, 0.0, 1.0)


def hit_ratio(cache_bytes: ArrayLike, dataset_bytes: ArrayLike) -> ArrayOrFloat:
    """Steady-state hit ratio ``h = c / d`` of a fixed cached subset under per-epoch random order.

    Clipped to [0, 1]; ``d = 0`` (no dataset) counts as fully cached (1.0).
    """
    cache = _checked("cache_bytes", cache_bytes)
    dataset = _checked("dataset_bytes", dataset_bytes)
    return _result(1.0 - _miss_ratio(cache, dataset), cache_bytes, dataset_bytes)


def io_bound_samples_per_s(
    remote_io_bytes_per_s: ArrayLike,
    cache_bytes: ArrayLike,
    dataset_bytes: ArrayLike,
    bytes_per_sample: ArrayLike,
) -> ArrayOrFloat:
    """Samples/s the IO grant sustains: ``R_io = b / (s * (1 - c/d))``.

    Every miss costs ``s`` remote bytes and a fraction ``1 - h`` of samples miss, so ``b``
    bytes/s feed ``b / (s (1 - h))`` samples/s. ``inf`` when no remote bytes are needed
    (``c >= d``, ``d = 0`` or ``s = 0``); 0 when ``b = 0`` and some samples miss.
    """
    bandwidth = _checked("remote_io_bytes_per_s", remote_io_bytes_per_s)
    cache = _checked("cache_bytes", cache_bytes)
    dataset = _checked("dataset_bytes", dataset_bytes)
    sample = _checked("bytes_per_sample", bytes_per_sample)
    remote_bytes_per_sample = sample * _miss_ratio(cache, dataset)
    needs_io = remote_bytes_per_sample > 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rate = np.where(needs_io, bandwidth / np.where(needs_io, remote_bytes_per_sample, 1.0), np.inf)
    return _result(rate, remote_io_bytes_per_s, cache_bytes, dataset_bytes, bytes_per_sample)


def throughput_samples_per_s(compute_samples_per_s: ArrayLike, io_bound: ArrayLike) -> ArrayOrFloat:
    """Throughput ``min(T(g), R_io)``: the job runs at the slower of compute and IO."""
    compute = _checked("compute_samples_per_s", compute_samples_per_s)
    io_rate = _checked("io_bound_samples_per_s", io_bound)
    return _result(np.minimum(compute, io_rate), compute_samples_per_s, io_bound)


def io_demand_bytes_per_s(
    compute_samples_per_s: ArrayLike,
    cache_bytes: ArrayLike,
    dataset_bytes: ArrayLike,
    bytes_per_sample: ArrayLike,
) -> ArrayOrFloat:
    """Remote IO needed to run at compute speed: ``b* = T(g) * s * (1 - c/d)`` bytes/s.

    Granting more than ``b*`` does not make the job faster; 0 when fully cached, when
    ``T(g) = 0`` (no GPUs), ``d = 0`` or ``s = 0``.
    """
    compute = _checked("compute_samples_per_s", compute_samples_per_s)
    cache = _checked("cache_bytes", cache_bytes)
    dataset = _checked("dataset_bytes", dataset_bytes)
    sample = _checked("bytes_per_sample", bytes_per_sample)
    demand = compute * sample * _miss_ratio(cache, dataset)
    return _result(demand, compute_samples_per_s, cache_bytes, dataset_bytes, bytes_per_sample)


def cache_efficiency(
    compute_samples_per_s: ArrayLike, dataset_bytes: ArrayLike, bytes_per_sample: ArrayLike
) -> ArrayOrFloat:
    """Remote IO saved per cached byte at compute speed: ``T(g) * s / d`` ((bytes/s) per byte).

    It is ``-d b* / d c``: each cached byte turns that many bytes/s of remote reads into
    hits. Highest for fast jobs on small datasets. 0 when ``d = 0`` (nothing to cache), when
    ``s = 0`` or ``T(g) = 0``.
    """
    compute = _checked("compute_samples_per_s", compute_samples_per_s)
    dataset = _checked("dataset_bytes", dataset_bytes)
    sample = _checked("bytes_per_sample", bytes_per_sample)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        efficiency = np.where(dataset > 0, compute * sample / np.where(dataset > 0, dataset, 1.0), 0.0)
    return _result(efficiency, compute_samples_per_s, dataset_bytes, bytes_per_sample)


class SiloDEstimate(NamedTuple):
    """All SiloD figures for one or many (job, allocation) pairs; see the module docstring."""

    hit_ratio: ArrayOrFloat  # 0..1
    io_bound_samples_per_s: ArrayOrFloat  # samples/s, inf when no remote IO is needed
    throughput_samples_per_s: ArrayOrFloat  # samples/s
    io_demand_bytes_per_s: ArrayOrFloat  # bytes/s
    cache_efficiency: ArrayOrFloat  # (bytes/s) per cached byte


def estimate(
    compute_samples_per_s: ArrayLike,
    cache_bytes: ArrayLike,
    remote_io_bytes_per_s: ArrayLike,
    dataset_bytes: ArrayLike,
    bytes_per_sample: ArrayLike,
) -> SiloDEstimate:
    """Evaluate every SiloD formula at once for broadcastable inputs."""
    io_rate = io_bound_samples_per_s(remote_io_bytes_per_s, cache_bytes, dataset_bytes, bytes_per_sample)
    return SiloDEstimate(
        hit_ratio=hit_ratio(cache_bytes, dataset_bytes),
        io_bound_samples_per_s=io_rate,
        throughput_samples_per_s=throughput_samples_per_s(compute_samples_per_s, io_rate),
        io_demand_bytes_per_s=io_demand_bytes_per_s(compute_samples_per_s, cache_bytes, dataset_bytes, bytes_per_sample),
        cache_efficiency=cache_efficiency(compute_samples_per_s, dataset_bytes, bytes_per_sample),
    )


# --- LRU on per-epoch random permutations -------------------------------------------------


def lru_hit_ratio(cache_bytes: ArrayLike, dataset_bytes: ArrayLike) -> ArrayOrFloat:
    """Steady-state hit ratio of an LRU cache when every epoch is a fresh random permutation.

    With ``k = c / d`` (fraction of the dataset the cache holds), for ``k < 1``::

        h_lru(k) = k + (1 - k) * ln(1 - k)          (~ k**2 / 2 for small k)

    and 1 for ``k >= 1`` (after the first, cold epoch). Compare ``h = k`` for a fixed cached
    subset: at ``k = 0.5`` LRU hits 15.3 % instead of 50 %, at ``k = 0.9`` 67 % instead of 90 %.

    Derivation (large dataset limit). LRU hits a request iff fewer than ``c`` distinct samples
    were read since the previous request of the same sample. A sample read at fraction ``u``
    of the current epoch and at fraction ``1 - v`` of the previous one (``v``: fraction of
    the previous epoch left after it) has, in between, the ``u`` already read this epoch plus
    the previous epoch's last ``v`` that were not yet re-read this epoch, ``v (1 - u)``:
    ``u + v - u v`` of the dataset. Hit iff ``(1 - u)(1 - v) > 1 - k``. ``u`` and ``v`` are
    independent and uniform, and ``P(U V > a) = 1 - a + a ln a`` for uniform ``U, V``, which
    with ``a = 1 - k`` gives the formula. :func:`simulate_lru_hit_ratio` checks it with a real
    LRU; finite datasets deviate by O(1 / samples).
    """
    cache = _checked("cache_bytes", cache_bytes)
    dataset = _checked("dataset_bytes", dataset_bytes)
    fraction = 1.0 - _miss_ratio(cache, dataset)
    partial = fraction < 1.0
    safe = np.where(partial, fraction, 0.0)
    hits = np.where(partial, safe + (1.0 - safe) * np.log1p(-safe), 1.0)
    return _result(hits, cache_bytes, dataset_bytes)


def simulate_lru_hit_ratio(num_samples: int, cache_samples: int, epochs: int = 4, seed: int = 0) -> float:
    """Measured hit ratio of a real LRU cache over per-epoch random permutations.

    Reads ``epochs`` epochs of ``num_samples`` samples, each a fresh permutation drawn from
    ``numpy.random.default_rng(seed)``, through an LRU cache of ``cache_samples`` entries and
    returns hits / reads over all epochs but the first (cold) one. Cost O(num_samples *
    epochs); meant for tests and calibration, not for the scheduling hot path.
    """
    if num_samples <= 0 or cache_samples < 0 or epochs < 2:
        raise ValueError("need num_samples > 0, cache_samples >= 0 and epochs >= 2")
    from collections import OrderedDict

    rng = np.random.default_rng(seed)
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for epoch in range(epochs):
        for sample in rng.permutation(num_samples).tolist():
            if sample in cache:
                cache.move_to_end(sample)
                hits += epoch > 0
                continue
            if cache_samples == 0:
                continue
            cache[sample] = None
            if len(cache) > cache_samples:
                cache.popitem(last=False)
    return hits / (num_samples * (epochs - 1))
