"""Per-type job models: Gavel's measured speeds, the compute-time scaling, and Sia-style bootstrapping."""

from __future__ import annotations

import numpy as np
import pytest

from estimator import gpu_types as gt
from estimator.job_model import JobModel
from estimator.predict import predict_one


def test_the_measured_table_has_gavel_job_types_on_three_types():
    table = gt.measured_steps_per_s()
    assert gt.measured_types() == ("k80", "p100", "v100")
    assert len(table) == 26 and all(set(by_type) == {"k80", "p100", "v100"} for by_type in table.values())
    # Gavel measured ResNet-50 at batch 128: 0.347 steps/s on a K80, far below a V100.
    assert table["ResNet-50 (batch size 128)"]["k80"] == pytest.approx(0.347, abs=1e-3)


@pytest.mark.parametrize("application", sorted(set(gt.APPLICATION_JOB_TYPES) - {"ncf"}))
def test_compute_bound_applications_are_slower_on_older_types(application):
    k80, p100 = gt.application_speed(application, "k80"), gt.application_speed(application, "p100")
    assert gt.application_speed(application, "v100") == 1.0
    assert 0 < k80 < p100 < 1.0, (application, k80, p100)


def test_the_recommendation_model_is_faster_on_older_types_as_gavel_measured():
    # Gavel's table: Recommendation (batch 2048) 10.4 steps/s on a K80, 16.6 on a P100, 7.5 on a
    # V100 — the heterogeneity a type-aware policy can exploit (give the V100s to others).
    assert gt.application_speed("ncf", "k80") == pytest.approx(10.44122 / 7.469632)
    assert gt.application_speed("ncf", "p100") > gt.application_speed("ncf", "k80") > 1.0


def test_a_typed_model_computes_speed_times_faster_on_one_gpu():
    model = JobModel.from_profile("imagenet")
    speed = gt.application_speed("imagenet", "k80")
    k80 = gt.on_type(model, "k80", speed)
    assert k80.gpu_type == "k80" and k80.perf[2:] == model.perf[2:]
    base = predict_one(model, 1, batch_size=200).compute_samples_per_s[0]
    slow = predict_one(k80, 1, batch_size=200).compute_samples_per_s[0]
    assert slow / base == pytest.approx(speed, rel=1e-9)


def test_a_faster_type_gains_less_on_many_nodes_where_the_network_costs():
    model = JobModel.from_profile("bert")
    fast = gt.on_type(model, "h100", 3.0)
    one = predict_one(fast, 1, batch_size=12).compute_samples_per_s[0] / predict_one(model, 1, batch_size=12).compute_samples_per_s[0]
    many = (predict_one(fast, 16, 4, batch_size=192).compute_samples_per_s[0]
            / predict_one(model, 16, 4, batch_size=192).compute_samples_per_s[0])
    assert one == pytest.approx(3.0) and 1.0 < many < one


def test_typed_models_prefer_given_speeds_then_the_job_type_then_the_application():
    model = JobModel.from_profile("cifar10")
    models = gt.typed_models(model, ["", "v100", "k80", "a100"], job_type="CycleGAN", speeds={"a100": 2.0})
    assert set(models) == {"v100", "k80", "a100"}  # untyped nodes use the model itself
    assert models["a100"].perf.alpha_c == pytest.approx(model.perf.alpha_c / 2.0)
    assert models["k80"].perf.alpha_c == pytest.approx(model.perf.alpha_c / gt.job_type_speed("CycleGAN", "k80"))
    assert gt.typed_models(model, ["l4"])["l4"].perf == model.perf  # unknown and unobserved: neutral


def test_an_unseen_type_is_bootstrapped_from_three_measured_steps():
    model = JobModel.from_profile("deepspeech2")
    truth = gt.on_type(model, "a100", 2.4)
    local = np.array([10.0, 20.0, 40.0])
    measured = truth.perf.alpha_c + truth.perf.beta_c * local
    noisy = measured * np.array([1.0, 1.02, 3.0])  # one straggler step
    assert gt.speed_from_observations(model, local[:1], measured[:1]) == pytest.approx(2.4)
    assert gt.speed_from_observations(model, local, noisy) == pytest.approx(2.4 / 1.02, rel=1e-6)
    with pytest.raises(ValueError, match="no usable observation"):
        gt.speed_from_observations(model, [0.0], [1.0])
