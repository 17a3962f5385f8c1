"""Per-type online fitting: the table's guess, the one-step bootstrap, then the type's own fit."""

from __future__ import annotations

import numpy as np
import pytest

from estimator.goodput import step_time
from estimator.gpu_types import application_speed
from estimator.job_model import JobModel
from estimator.per_type import FULL_FIT_CONFIGURATIONS, TypedModels


def steps_on(perf, gpus, nodes, batch):
    local = np.asarray(batch, dtype=float) / np.asarray(gpus)
    steps = step_time(perf, nodes, gpus, local)
    return steps, steps - (perf.alpha_c + perf.beta_c * local)


def test_unseen_types_start_from_the_measured_table_and_unknown_ones_from_the_reference():
    models = TypedModels(JobModel.from_profile("imagenet"))
    k80 = models.model_on("k80")
    assert k80.perf.alpha_c == pytest.approx(models.reference.perf.alpha_c / application_speed("imagenet", "k80"))
    assert models.model_on("l4").perf == models.reference.perf
    assert models.model_on("v100") is models.reference


def test_one_step_on_a_new_type_bootstraps_its_speed():
    reference = JobModel.from_profile("cifar10")
    # An "h100" the table does not know: compute 3x the reference's, faster network too.
    truth = reference.perf._replace(alpha_c=reference.perf.alpha_c / 3, beta_c=reference.perf.beta_c / 3,
                                    alpha_r=reference.perf.alpha_r / 2)
    models = TypedModels(reference)
    step, sync = steps_on(truth, [1], [1], [128])
    fitted = models.observe("h100", [1], [1], [128], step, sync)
    assert models.speeds["h100"] == pytest.approx(3.0, rel=1e-6)
    assert fitted.gpu_type == "h100" and fitted.perf.alpha_r == reference.perf.alpha_r  # not identifiable yet
    assert models.model_on("h100") is fitted


def test_enough_configurations_fit_the_types_own_model():
    reference = JobModel.from_profile("cifar10")
    truth = reference.perf._replace(alpha_c=reference.perf.alpha_c / 3, beta_c=reference.perf.beta_c / 3,
                                    alpha_r=reference.perf.alpha_r / 2, beta_r=reference.perf.beta_r / 2)
    models = TypedModels(reference)
    gpus, nodes, batch = np.array([1, 2, 4, 4]), np.array([1, 1, 1, 1]), np.array([128, 256, 512, 1024])
    step, sync = steps_on(truth, gpus, nodes, batch)
    fitted = models.observe("h100", gpus, nodes, batch, step, sync)
    assert len({(g, b / g) for g, b in zip(gpus, batch)}) >= FULL_FIT_CONFIGURATIONS
    predicted, _ = steps_on(fitted.perf, gpus, nodes, batch)
    np.testing.assert_allclose(predicted, step, rtol=0.03)
    # The bootstrap alone (reference network terms) would miss the faster synchronisation.
    scaled = reference.perf._replace(alpha_c=reference.perf.alpha_c / 3, beta_c=reference.perf.beta_c / 3)
    assert np.abs(steps_on(scaled, gpus, nodes, batch)[0] - step).max() > np.abs(predicted - step).max()


def test_gradient_reports_from_any_type_update_the_shared_statistics_and_references_refit_the_others():
    reference = JobModel.from_profile("bert")
    models = TypedModels(reference)
    step, sync = steps_on(reference.perf, [1], [1], [12])
    models.observe("k80", [1], [1], [12], step * 4, sync, grad_sqr=[3.0], grad_var=[90.0])
    assert models.reference.grad == (3.0, 90.0) and models.model_on("k80").grad == (3.0, 90.0)
    assert models.speeds["k80"] == pytest.approx(0.25, rel=1e-6)
    # Steps on the reference type refit it; the k80 model still matches what the k80 measured.
    slower = reference.perf._replace(alpha_c=reference.perf.alpha_c * 1.5, beta_c=reference.perf.beta_c * 1.5)
    ref_step, ref_sync = steps_on(slower, [1, 1], [1, 1], [12, 6])
    models.observe("v100", [1, 1], [1, 1], [12, 6], ref_step, ref_sync)
    assert models.reference.perf.beta_c > reference.perf.beta_c
    k80 = models.model_on("k80").perf
    assert k80.alpha_c + k80.beta_c * 12 == pytest.approx(float(step[0] * 4), rel=1e-6)
    with pytest.raises(ValueError):
        models.observe("k80", [0], [1], [12], [1.0])
