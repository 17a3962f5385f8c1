"""The SiloD formulas against values computed by hand, their edge cases, and their properties."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import silod_model as sm

# One job used throughout: d = 1000 B dataset, s = 10 B/sample, T(g) = 50 samples/s.
D, S, T = 1000.0, 10.0, 50.0


def test_partial_cache_hand_computed():
    # c = 250 B cached, b = 300 B/s remote IO.
    assert sm.hit_ratio(250, D) == 0.25  # 250 / 1000
    assert sm.io_bound_samples_per_s(300, 250, D, S) == pytest.approx(40.0)  # 300 / (10 * (1 - 0.25)) = 300 / 7.5
    assert sm.throughput_samples_per_s(T, 40.0) == 40.0  # min(50, 40): IO-bound
    assert sm.io_demand_bytes_per_s(T, 250, D, S) == pytest.approx(375.0)  # 50 * 10 * 0.75
    assert sm.cache_efficiency(T, D, S) == pytest.approx(0.5)  # 50 * 10 / 1000


def test_estimate_bundles_every_formula():
    e = sm.estimate(T, 250, 300, D, S)
    assert e == pytest.approx(sm.SiloDEstimate(0.25, 40.0, 40.0, 375.0, 0.5))
    # With 1000 B/s the same job is compute-bound: R_io = 1000 / 7.5 = 133.33 > 50.
    assert sm.estimate(T, 250, 1000, D, S).throughput_samples_per_s == 50.0


def test_no_cache():
    # c = 0: h = 0, R_io = b / s = 300 / 10 = 30, b* = T * s = 500.
    assert sm.hit_ratio(0, D) == 0.0
    assert sm.io_bound_samples_per_s(300, 0, D, S) == pytest.approx(30.0)
    assert sm.io_demand_bytes_per_s(T, 0, D, S) == pytest.approx(500.0)


@pytest.mark.parametrize("cache", [1000.0, 1500.0])
def test_fully_cached_needs_no_io(cache):
    # c >= d: h = 1, R_io = inf (even with b = 0), b* = 0, throughput = T.
    assert sm.hit_ratio(cache, D) == 1.0
    assert sm.io_bound_samples_per_s(0, cache, D, S) == math.inf
    assert sm.throughput_samples_per_s(T, math.inf) == T
    assert sm.io_demand_bytes_per_s(T, cache, D, S) == 0.0
    # Efficiency is a property of the job, not of the grant: 50 * 10 / 1000.
    assert sm.cache_efficiency(T, D, S) == pytest.approx(0.5)


def test_no_bandwidth():
    # b = 0 and c < d: R_io = 0 / (10 * 0.5) = 0, so throughput 0 whatever the GPUs.
    assert sm.io_bound_samples_per_s(0, 500, D, S) == 0.0
    assert sm.estimate(T, 500, 0, D, S).throughput_samples_per_s == 0.0


def test_no_gpus():
    # g = 0: T(0) = 0, so throughput 0, IO demand 0 * 10 * 0.75 = 0, efficiency 0 * 10 / 1000 = 0.
    e = sm.estimate(0.0, 250, 300, D, S)
    assert e.throughput_samples_per_s == 0.0
    assert e.io_demand_bytes_per_s == 0.0
    assert e.cache_efficiency == 0.0
    assert e.io_bound_samples_per_s == pytest.approx(40.0)  # the IO grant is unchanged


def test_no_dataset():
    # d = 0: nothing to read: h = 1, R_io = inf, b* = 0, nothing to cache: efficiency 0.
    e = sm.estimate(T, 0, 0, 0, S)
    assert e == (1.0, math.inf, T, 0.0, 0.0)


def test_zero_byte_samples():
    # s = 0: samples cost no remote bytes: R_io = inf, b* = 0, efficiency 0; h is still c / d.
    e = sm.estimate(T, 250, 0, D, 0)
    assert e == (0.25, math.inf, T, 0.0, 0.0)


def test_cache_beyond_dataset_is_clipped():
    assert sm.hit_ratio(5000, D) == 1.0


def test_vectorized_matches_scalars_and_returns_arrays():
    cache = np.array([0.0, 250.0, 1000.0])
    e = sm.estimate(T, cache, 300, D, S)
    assert isinstance(e.hit_ratio, np.ndarray)
    np.testing.assert_allclose(e.io_bound_samples_per_s, [30.0, 40.0, np.inf])
    np.testing.assert_allclose(e.throughput_samples_per_s, [30.0, 40.0, 50.0])
    np.testing.assert_allclose(e.io_demand_bytes_per_s, [500.0, 375.0, 0.0])
    assert isinstance(sm.hit_ratio(1, 2), float)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_input_names_the_argument(bad):
    with pytest.raises(ValueError, match="cache_bytes"):
        sm.hit_ratio(bad, D)
    with pytest.raises(ValueError, match="remote_io_bytes_per_s"):
        sm.io_bound_samples_per_s(np.array([1.0, bad]), 0, D, S)


# --- properties -----------------------------------------------------------------------------

sizes = st.floats(min_value=0.0, max_value=1e12, allow_nan=False)
positive = st.floats(min_value=1e-3, max_value=1e12, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(compute=sizes, dataset=sizes, sample=sizes, cache=sizes, extra_cache=sizes, io=sizes, extra_io=sizes)
def test_throughput_monotone_and_bounded(compute, dataset, sample, cache, extra_cache, io, extra_io):
    def rate(c, b):
        return sm.estimate(compute, c, b, dataset, sample).throughput_samples_per_s

    base = rate(cache, io)
    assert base <= compute
    assert rate(cache + extra_cache, io) >= base
    assert rate(cache, io + extra_io) >= base


@settings(max_examples=200, deadline=None)
@given(compute=sizes, dataset=sizes, sample=sizes, cache=sizes, extra_cache=sizes)
def test_io_demand_non_increasing_in_cache(compute, dataset, sample, cache, extra_cache):
    more = sm.io_demand_bytes_per_s(compute, cache + extra_cache, dataset, sample)
    assert more <= sm.io_demand_bytes_per_s(compute, cache, dataset, sample)


@settings(max_examples=200, deadline=None)
@given(compute=positive, dataset=positive, sample=positive, cache=sizes)
def test_granting_the_demand_reaches_compute_speed(compute, dataset, sample, cache):
    demand = sm.io_demand_bytes_per_s(compute, cache, dataset, sample)
    rate = sm.estimate(compute, cache, demand, dataset, sample).throughput_samples_per_s
    assert rate == pytest.approx(compute, rel=1e-9)


# --- LRU ------------------------------------------------------------------------------------


def test_lru_closed_form_hand_values():
    # k = 0.5: 0.5 + 0.5 * ln 0.5 = 0.5 - 0.34657 = 0.15343
    assert sm.lru_hit_ratio(500, 1000) == pytest.approx(0.5 + 0.5 * math.log(0.5))
    assert sm.lru_hit_ratio(500, 1000) == pytest.approx(0.153426, abs=1e-6)
    assert sm.lru_hit_ratio(0, 1000) == 0.0
    assert sm.lru_hit_ratio(1000, 1000) == 1.0  # fully cached: everything hits after epoch 1
    assert sm.lru_hit_ratio(10, 0) == 1.0  # no dataset, as for the uniform model
    # Small caches: ~ k^2 / 2 (k = 0.01 -> 5.0e-5).
    assert sm.lru_hit_ratio(10, 1000) == pytest.approx(0.01**2 / 2, rel=0.01)


def test_lru_never_beats_a_fixed_subset():
    k = np.linspace(0, 1, 101)
    assert np.all(sm.lru_hit_ratio(k, 1.0) <= sm.hit_ratio(k, 1.0) + 1e-15)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.8, 0.95])
def test_lru_closed_form_matches_simulation(fraction):
    samples = 4000
    simulated = sm.simulate_lru_hit_ratio(samples, int(fraction * samples), epochs=4, seed=7)
    assert simulated == pytest.approx(sm.lru_hit_ratio(fraction, 1.0), abs=0.01)


def test_lru_simulation_edges():
    assert sm.simulate_lru_hit_ratio(100, 0, epochs=3) == 0.0
    assert sm.simulate_lru_hit_ratio(100, 100, epochs=3) == 1.0
    with pytest.raises(ValueError):
        sm.simulate_lru_hit_ratio(100, 10, epochs=1)
