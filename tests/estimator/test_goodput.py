"""The Pollux goodput model: hand-computed step times, efficiency, best batch size, speedup base."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import goodput as gp
from estimator.goodput import BatchBounds, GradParams, PerfParams

PERF = PerfParams(alpha_c=0.05, beta_c=0.002, alpha_n=0.2, beta_n=0.01, alpha_r=0.02, beta_r=0.005, gamma=2.0)
GRAD = GradParams(sqr=1.0, var=50.0)
BOUNDS = BatchBounds(init_batch_size=128, max_batch_size=4096, min_local_bsz=32, max_local_bsz=512)


def test_step_time_hand_computed():
    # One GPU, 100 samples: T_grad = 0.05 + 0.002 * 100 = 0.25, T_sync = 0 -> 0.25 s.
    assert gp.step_time(PERF, 1, 1, 100) == pytest.approx(0.25)
    # One node, 4 GPUs: T_sync = 0.02 + 0.005 * (4 - 2) = 0.03; (0.25^2 + 0.03^2)^(1/2) = 0.251794
    assert gp.sync_time(PERF, 1, 4) == pytest.approx(0.03)
    assert gp.step_time(PERF, 1, 4, 100) == pytest.approx(math.hypot(0.25, 0.03))
    # Two nodes, 8 GPUs: T_sync = 0.2 + 0.01 * 6 = 0.26; hypot(0.25, 0.26) = 0.360694
    assert gp.step_time(PERF, 2, 8, 100) == pytest.approx(math.hypot(0.25, 0.26))
    # Two replicas: no retrogression term: T_sync = alpha_n = 0.2.
    assert gp.sync_time(PERF, 2, 2) == pytest.approx(0.2)
    # Two accumulation steps add 2 * T_grad: 0.5 + 0.360694.
    assert gp.step_time(PERF, 2, 8, 100, 2) == pytest.approx(0.5 + math.hypot(0.25, 0.26))
    # gamma = 1 adds compute and sync: 0.25 + 0.26.
    assert gp.step_time(PERF._replace(gamma=1.0), 2, 8, 100) == pytest.approx(0.51)


def test_step_time_large_gamma_approaches_max_without_overflow():
    perf = PERF._replace(gamma=10.0, alpha_c=1e3, beta_c=0.0)
    # (1000^10 + 0.26^10)^(1/10) = 1000 to double precision.
    assert gp.step_time(perf, 2, 8, 1) == pytest.approx(1000.0)


def test_throughput_hand_computed():
    # 8 GPUs x 100 samples x (2 + 1) micro-batches / (0.5 + 0.360694) s = 2400 / 0.860694 = 2788.44
    assert gp.throughput(PERF, 2, 8, 100, 2) == pytest.approx(2400 / (0.5 + math.hypot(0.25, 0.26)))


def test_efficiency_hand_computed():
    # B0 = 128, B = 512: ratio 4; E = (50 + 1) / (50 + 1 * 4) = 51 / 54 = 0.94444
    assert gp.efficiency(GRAD, 128, 512) == pytest.approx(51 / 54)
    # Noise scale B0 * var / sqr = 6400; (6400 + 128) / (6400 + 512) is the same number.
    assert gp.noise_scale(GRAD, 128) == pytest.approx(6400)
    assert gp.efficiency(GRAD, 128, 512) == pytest.approx((6400 + 128) / (6400 + 512))
    # No noise: E = B0 / B = 0.25; nothing known (both 0): Pollux's convention, also B0 / B.
    assert gp.efficiency(GradParams(1.0, 0.0), 128, 512) == pytest.approx(0.25)
    assert gp.efficiency(GradParams(0.0, 0.0), 128, 512) == pytest.approx(0.25)
    # Pure noise: perfect scaling.
    assert gp.efficiency(GradParams(0.0, 1.0), 128, 512) == 1.0


def test_efficiency_is_one_at_init_and_decreasing():
    batches = np.array([128, 129, 256, 1000, 4096, 1e6])
    values = gp.efficiency(GRAD, 128, batches)
    assert values[0] == 1.0
    assert np.all(np.diff(values) < 0)
    # Smaller than B0 is not credited above 1.
    assert gp.efficiency(GRAD, 128, 64) == 1.0


@settings(max_examples=100, deadline=None)
@given(
    sqr=st.floats(1e-6, 1e6),
    var=st.floats(0, 1e8),
    init=st.integers(1, 1000),
    growth=st.floats(1.0, 1000.0),
)
def test_efficiency_in_unit_interval_and_monotone(sqr, var, init, growth):
    grad = GradParams(sqr, var)
    small, large = gp.efficiency(grad, init, init * growth), gp.efficiency(grad, init, init * growth * 2)
    assert 0 < large <= small <= 1


def test_split_local_batch():
    atomic, accum = gp.split_local_batch([100, 512, 513, 1500], 512)
    np.testing.assert_array_equal(atomic, [100, 512, 257, 500])
    np.testing.assert_array_equal(accum, [0, 0, 1, 2])


def _brute_force(perf, grad, bounds, nodes, replicas, cap=np.inf):
    low = max(bounds.init_batch_size, replicas * bounds.min_local_bsz)
    batches = np.arange(low, max(bounds.max_batch_size, low) + 1)
    atomic, accum = gp.split_local_batch(batches / replicas, bounds.max_local_bsz)
    values = gp.goodput(perf, grad, bounds.init_batch_size, nodes, replicas, atomic, accum, cap)
    return values.max()


SHAPES = [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16), (8, 32), (16, 64)]


@pytest.mark.parametrize("nodes,replicas", SHAPES)
@pytest.mark.parametrize("grad", [GRAD, GradParams(1.0, 2000.0), GradParams(1.0, 0.5)])
def test_best_batch_matches_brute_force(nodes, replicas, grad):
    best = gp.best_batch(PERF, grad, BOUNDS, nodes, replicas)
    assert float(best.goodput) >= 0.9995 * _brute_force(PERF, grad, BOUNDS, nodes, replicas)
    # The reported configuration really yields the reported goodput.
    again = gp.goodput(PERF, grad, BOUNDS.init_batch_size, nodes, replicas, best.atomic_bsz, best.accum_steps)
    assert float(again) == pytest.approx(float(best.goodput))
    assert best.batch_size == replicas * best.atomic_bsz * (best.accum_steps + 1)
    assert best.atomic_bsz <= BOUNDS.max_local_bsz


@pytest.mark.parametrize("cap", [200.0, 1000.0, 5000.0])
@pytest.mark.parametrize("nodes,replicas", [(1, 1), (1, 4), (4, 16)])
def test_best_batch_under_io_cap_matches_brute_force(nodes, replicas, cap):
    best = gp.best_batch(PERF, GRAD, BOUNDS, nodes, replicas, cap)
    assert float(best.goodput) >= 0.9995 * _brute_force(PERF, GRAD, BOUNDS, nodes, replicas, cap)


def test_io_cap_shrinks_the_best_batch():
    free = gp.best_batch(PERF, GradParams(1.0, 2000.0), BOUNDS, 4, 16)
    capped = gp.best_batch(PERF, GradParams(1.0, 2000.0), BOUNDS, 4, 16, 1000.0)
    assert capped.batch_size < free.batch_size


def test_best_batch_uses_accumulation_beyond_max_local():
    # One GPU holding 64 samples cannot run B0 = 128 in one pass: two micro-batches of 64.
    bounds = BOUNDS._replace(max_local_bsz=64)
    best = gp.best_batch(PERF, GRAD, bounds, 1, 1)
    assert best.batch_size >= 128
    assert best.atomic_bsz <= 64 and best.accum_steps >= 1
    assert float(best.goodput) >= 0.9995 * _brute_force(PERF, GRAD, bounds, 1, 1)


def test_best_batch_respects_min_local_when_bounds_conflict():
    # 64 GPUs x 100 samples > max batch 4096: every GPU still gets min_local_bsz.
    bounds = BOUNDS._replace(min_local_bsz=100)
    best = gp.best_batch(PERF, GRAD, bounds, 16, 64)
    assert best.batch_size == 6400


def test_best_batch_grouped_equals_ungrouped():
    nodes, replicas = np.array([1, 1, 4]), np.array([1, 4, 16])
    caps = np.array([np.inf, 300.0, np.inf, 800.0, 50.0])
    group = np.array([0, 0, 1, 2, 2])
    grouped = gp.best_batch_grouped(PERF, GRAD, BOUNDS, nodes, replicas, group, caps)
    single = gp.best_batch(PERF, GRAD, BOUNDS, nodes[group], replicas[group], caps)
    for a, b in zip(grouped, single):
        np.testing.assert_allclose(a, b)


def test_best_batch_vectorized_over_job_parameters():
    perfs = PerfParams(*(np.array([v, v * 2]) if i < 6 else np.array([v, v]) for i, v in enumerate(PERF)))
    grads = GradParams(np.array([1.0, 1.0]), np.array([50.0, 2000.0]))
    bounds = BatchBounds(*(np.array([v, v]) for v in BOUNDS))
    both = gp.best_batch(perfs, grads, bounds, np.array([2, 2]), np.array([8, 8]))
    first = gp.best_batch(PERF, GRAD, BOUNDS, 2, 8)
    second = gp.best_batch(PerfParams(*(v * 2 if i < 6 else v for i, v in enumerate(PERF))), GradParams(1.0, 2000.0), BOUNDS, 2, 8)
    np.testing.assert_allclose(both.goodput, [first.goodput, second.goodput])


def test_speedup_of_the_base_allocation_is_one():
    assert gp.speedup(PERF, GRAD, BOUNDS, 1, 1) == pytest.approx(1.0)
    assert gp.speedup(PERF, GRAD, BOUNDS, 2, 8, base_nodes=2, base_replicas=8) == pytest.approx(1.0)
    values = gp.speedup(PERF, GRAD, BOUNDS, np.array([1, 1, 2, 4]), np.array([1, 4, 8, 16]))
    assert values[0] == pytest.approx(1.0)
    assert np.all(np.diff(values) > 0) and np.all(values <= np.array([1, 4, 8, 16]))
    # An IO cap below the 1-GPU rate costs speedup.
    assert gp.speedup(PERF, GRAD, BOUNDS, 1, 4, io_cap_samples_per_s=100.0) < 1.0
