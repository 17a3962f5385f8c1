"""Online fitting: PerfParams recovery from noisy steps, priors, gradient EMA, IO helpers."""

import numpy as np
import pytest

from estimator import fitting
from estimator.goodput import GradParams, PerfParams, compute_time, step_time

TRUE = PerfParams(alpha_c=0.05, beta_c=0.002, alpha_n=0.2, beta_n=0.01, alpha_r=0.02, beta_r=0.005, gamma=2.0)
# Parameters a rich set of observations pins down. alpha_r and beta_r are not among them:
# intra-node sync (0.02-0.05 s) hides under compute (0.06-0.56 s) at gamma = 2, so it moves
# step times by well under the noise and only matters for predictions that much.
IDENTIFIABLE = ("alpha_c", "beta_c", "alpha_n", "beta_n", "gamma")

SHAPES = [(1, 1), (1, 2), (1, 4), (1, 6), (1, 8), (2, 2), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16), (4, 32), (8, 64)]
BATCHES = [4, 8, 16, 32, 64, 128, 256]


def synthetic(perf: PerfParams, seed: int, noise: float = 0.02):
    """Observations from ``perf`` with independent multiplicative noise on step and sync time."""
    rows = [(n, r, b, 0) for n, r in SHAPES for b in BATCHES] + [(1, 1, 256, 1), (2, 4, 256, 2)]
    nodes, replicas, bsz, accum = (np.array(c, dtype=float) for c in zip(*rows))
    exact = step_time(perf, nodes, replicas, bsz, accum)
    sync = exact - compute_time(perf, bsz) * (accum + 1)  # the part of the step compute does not cover
    rng = np.random.default_rng(seed)
    observed_step = exact * (1 + noise * rng.standard_normal(exact.shape))
    observed_sync = sync * (1 + noise * rng.standard_normal(exact.shape))
    return (nodes, replicas, bsz, accum, observed_step, observed_sync), exact


@pytest.mark.parametrize("seed", range(4))
def test_recovers_known_params_from_noisy_steps(seed):
    (nodes, replicas, bsz, accum, step, sync), exact = synthetic(TRUE, seed)
    fit = fitting.fit_perf_params(nodes, replicas, bsz, accum, step, sync)
    predicted = step_time(fit, nodes, replicas, bsz, accum)
    assert np.max(np.abs(predicted / exact - 1)) < 0.05
    for name in IDENTIFIABLE:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name


def test_intra_node_params_identifiable_when_sync_dominates():
    heavy = TRUE._replace(alpha_r=0.1, beta_r=0.02)
    (nodes, replicas, bsz, accum, step, sync), _ = synthetic(heavy, seed=1)
    fit = fitting.fit_perf_params(nodes, replicas, bsz, accum, step, sync)
    assert fit.alpha_r == pytest.approx(0.1, rel=0.05)
    assert fit.beta_r == pytest.approx(0.02, rel=0.1)


def test_bounds_respected():
    # Data that would like negative constants and a gamma outside [1, 10].
    nodes = np.array([1, 1, 2, 2, 4])
    replicas = np.array([1, 1, 2, 4, 8])
    bsz = np.array([10, 100, 10, 10, 10])
    step = np.array([0.001, 1.0, 0.002, 0.003, 0.5])
    sync = np.array([0.0, 0.0, 0.001, 0.002, 0.49])
    fit = fitting.fit_perf_params(nodes, replicas, bsz, 0, step, sync)
    assert min(fit[:6]) >= 1e-8
    assert 1.0 <= fit.gamma <= 10.0


def test_unidentified_params_keep_the_prior():
    # Only single-node, single-batch-size observations: network params and the compute
    # split come from the prior; compute time is matched.
    prior = PerfParams(0.04, 0.003, 0.3, 0.02, 0.03, 0.004, 3.0)
    nodes, replicas, bsz = np.array([1, 1]), np.array([1, 1]), np.array([64, 64])
    step = np.array([0.5, 0.5])
    fit = fitting.fit_perf_params(nodes, replicas, bsz, 0, step, 0, prior=prior)
    assert (fit.alpha_n, fit.beta_n, fit.alpha_r, fit.beta_r, fit.gamma) == pytest.approx(prior[2:])
    assert float(compute_time(fit, 64)) == pytest.approx(0.5, rel=1e-4)
    # The prior's constant/linear split (0.04 : 0.192) is kept, scaled to 0.5 s.
    scale = 0.5 / (0.04 + 0.003 * 64)
    assert fit.alpha_c == pytest.approx(0.04 * scale, rel=1e-6)


def test_without_prior_inter_node_sync_is_at_least_intra_node():
    (nodes, replicas, bsz, accum, step, sync), _ = synthetic(TRUE, seed=0)
    single_node = nodes == 1
    fit = fitting.fit_perf_params(nodes[single_node], replicas[single_node], bsz[single_node], 0, step[single_node], sync[single_node])
    assert fit.alpha_n >= 1.1 * fit.alpha_r * 0.999
    assert fit.beta_n >= 1.1 * fit.beta_r * 0.999


def test_rejects_bad_observations():
    with pytest.raises(ValueError, match="replicas"):
        fitting.fit_perf_params([2], [1], [8], 0, [0.1], [0.0])
    with pytest.raises(ValueError, match="step_time"):
        fitting.fit_perf_params([1], [1], [8], 0, [float("nan")], [0.0])


def test_observation_log_averages_and_round_trips():
    log = fitting.ObservationLog()
    log.add(1, 2, 32, 0, 0.30, 0.05)
    log.add(1, 2, 32, 0, 0.50, 0.15)  # same configuration: averaged
    log.add(2, 4, 64, 1, 0.80, 0.20)
    obs = log.observations()
    np.testing.assert_allclose(obs.step_time, [0.40, 0.80])
    np.testing.assert_allclose(obs.sync_time, [0.10, 0.20])
    params = log.to_params()
    assert params["obs.0.step_time_s"] == pytest.approx(0.40)
    again = fitting.ObservationLog.from_params({**params, "perf.alpha_c_s": 1.0})
    np.testing.assert_allclose(again.observations().step_time, obs.step_time)
    assert again.entries[(1, 2, 32, 0)][0] == 2  # the weight survives


def test_observation_log_fit_falls_back_to_prior():
    assert fitting.ObservationLog().fit(TRUE) == TRUE
    with pytest.raises(ValueError):
        fitting.ObservationLog().fit(None)


def test_grad_params_ema():
    prior = GradParams(10.0, 100.0)
    # First report replaces the prior; (0, 0) means "not measured" and is skipped.
    params, count = fitting.update_grad_params(prior, 0, [2.0, 0.0, 4.0], [20.0, 0.0, 40.0], weight=0.5)
    # 2 -> 0.5 * 2 + 0.5 * 4 = 3; 20 -> 0.5 * 20 + 0.5 * 40 = 30
    assert params == pytest.approx((3.0, 30.0))
    assert count == 2
    unchanged, count = fitting.update_grad_params(prior, 5, 0.0, 0.0)
    assert unchanged == prior and count == 5
    with pytest.raises(ValueError):
        fitting.update_grad_params(prior, 0, -1.0, 1.0)


def test_io_observation_helpers():
    # 100 samples/s, 25% hits, 10 B each: 100 * 10 * 0.75 = 750 B/s read remotely.
    assert fitting.remote_read_bytes_per_s(100, 0.25, 10) == pytest.approx(750.0)
    # And back: 750 / (100 * 0.75) = 10 B/sample; undefined when everything hit.
    assert fitting.bytes_per_sample_from_io(750, 100, 0.25) == pytest.approx(10.0)
    assert np.isnan(fitting.bytes_per_sample_from_io(750, 100, 1.0))
    np.testing.assert_array_equal(fitting.is_io_bound([80, 95, 100], 100), [True, False, False])



def test_analytic_gradient_matches_finite_differences():
    params = np.array([0.05, 0.002, 0.2, 0.01, 0.02, 0.005, 2.3])
    nodes = np.array([1, 1, 1, 2, 2, 4, 1])
    replicas = np.array([1, 2, 4, 2, 8, 16, 1])
    bsz = np.array([10, 100, 50, 20, 300, 5, 64])
    accum = np.array([0, 0, 1, 0, 2, 0, 3])
    value, gradient = fitting.step_time_gradient(PerfParams(*params), nodes, replicas, bsz, accum)
    np.testing.assert_allclose(value, step_time(PerfParams(*params), nodes, replicas, bsz, accum))
    for j in range(7):
        h = 1e-6 * params[j]
        up, down = params.copy(), params.copy()
        up[j] += h
        down[j] -= h
        numeric = (step_time(PerfParams(*up), nodes, replicas, bsz, accum) - step_time(PerfParams(*down), nodes, replicas, bsz, accum)) / (2 * h)
        np.testing.assert_allclose(gradient[:, j], numeric, rtol=1e-6, atol=1e-12)
