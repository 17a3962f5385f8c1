"""Batch prediction: agrees with the component models, handles edge cases, validates input."""

import math

import numpy as np
import pytest

from estimator import goodput as gp
from estimator import silod_model as sm
from estimator.goodput import BatchBounds, GradParams, PerfParams
from estimator.job_model import JobModel
from estimator.predict import ModelTable, predict, predict_one

JOB = JobModel(
    application="synthetic",
    perf=PerfParams(0.05, 0.002, 0.2, 0.01, 0.02, 0.005, 2.0),
    grad=GradParams(1.0, 50.0),
    bounds=BatchBounds(128, 4096, 32, 512),
    dataset_bytes=1e9,
    bytes_per_sample=1e5,
)


def test_explicit_batch_matches_the_component_models():
    # 8 GPUs on 2 nodes, batch 800 (100 per GPU), 25% of the dataset cached, 20 MB/s of IO.
    p = predict_one(JOB, gpus=8, nodes=2, cache_bytes=2.5e8, remote_io_bytes_per_s=2e7, batch_size=800)
    compute = float(gp.throughput(JOB.perf, 2, 8, 100))  # 800 / hypot(0.25, 0.26) = 2217.9
    assert p.compute_samples_per_s[0] == pytest.approx(compute)
    assert p.hit_ratio[0] == 0.25
    assert p.io_bound_samples_per_s[0] == pytest.approx(2e7 / (1e5 * 0.75))  # 266.7 samples/s
    assert p.throughput_samples_per_s[0] == pytest.approx(2e7 / 7.5e4)  # IO-bound
    eff = float(gp.efficiency(JOB.grad, 128, 800))  # 51 / (50 + 6.25)
    assert p.statistical_efficiency[0] == pytest.approx(51 / 56.25)
    assert p.goodput_samples_per_s[0] == pytest.approx(2e7 / 7.5e4 * eff)
    assert p.io_demand_bytes_per_s[0] == pytest.approx(compute * 1e5 * 0.75)
    assert p.cache_efficiency[0] == pytest.approx(compute * 1e5 / 1e9)
    assert p.batch_size[0] == 800


def test_best_batch_and_speedup():
    p = predict_one(JOB, gpus=[1, 4, 16], nodes=[1, 1, 4], cache_bytes=1e9, remote_io_bytes_per_s=0)
    # Fully cached: compute-bound; the 1-GPU candidate is the base allocation.
    assert p.speedup[0] == pytest.approx(1.0)
    best = gp.best_batch(JOB.perf, JOB.grad, JOB.bounds, np.array([1, 1, 4]), np.array([1, 4, 16]))
    np.testing.assert_allclose(p.goodput_samples_per_s, best.goodput)
    np.testing.assert_array_equal(p.batch_size, best.batch_size)
    np.testing.assert_allclose(p.speedup, best.goodput / best.goodput[0])
    assert np.all(np.diff(p.speedup) > 0)


def test_io_limits_speedup_and_shrinks_the_batch():
    free = predict_one(JOB, gpus=16, nodes=4, cache_bytes=1e9, remote_io_bytes_per_s=0)
    starved = predict_one(JOB, gpus=16, nodes=4, cache_bytes=0, remote_io_bytes_per_s=1e8)  # 1000 samples/s
    assert starved.throughput_samples_per_s[0] == pytest.approx(1000.0)
    assert starved.speedup[0] < free.speedup[0]
    assert starved.batch_size[0] < free.batch_size[0]


def test_no_gpus_and_packed_nodes():
    p = predict_one(JOB, gpus=[0, 5], nodes=0, cache_bytes=0, remote_io_bytes_per_s=1e7)
    assert p.compute_samples_per_s[0] == 0 and p.goodput_samples_per_s[0] == 0 and p.batch_size[0] == 0
    assert p.speedup[0] == 0 and p.io_demand_bytes_per_s[0] == 0 and p.statistical_efficiency[0] == 0
    assert p.io_bound_samples_per_s[0] == pytest.approx(100.0)  # still describes the IO grant
    # 5 GPUs packed on 4-GPU nodes span 2 nodes; on 8-GPU nodes one (faster sync).
    packed = predict_one(JOB, gpus=5, nodes=[0, 2, 1], cache_bytes=1e9, remote_io_bytes_per_s=0, batch_size=640)
    assert packed.compute_samples_per_s[0] == packed.compute_samples_per_s[1]
    eight = predict_one(JOB, gpus=5, nodes=0, cache_bytes=1e9, remote_io_bytes_per_s=0, batch_size=640, gpus_per_node=8)
    assert eight.compute_samples_per_s[0] == packed.compute_samples_per_s[2] > packed.compute_samples_per_s[0]


def test_fully_cached_has_infinite_io_rate():
    p = predict_one(JOB, gpus=1, cache_bytes=2e9, remote_io_bytes_per_s=0)
    assert p.io_bound_samples_per_s[0] == math.inf
    assert p.hit_ratio[0] == 1.0 and p.io_demand_bytes_per_s[0] == 0.0


def test_many_jobs_in_one_call_match_one_job_calls():
    other = JobModel.from_profile("imagenet")
    table = ModelTable([JOB, other])
    rng = np.random.default_rng(3)
    size = 200
    index = rng.integers(0, 2, size)
    gpus = rng.integers(0, 33, size)
    nodes = np.where(gpus > 0, np.minimum(gpus, rng.integers(0, 9, size)), 0)
    cache = rng.uniform(0, 1, size) * table.dataset_bytes[index]
    io = rng.uniform(0, 1e9, size)
    batch = np.where(rng.random(size) < 0.5, 0, rng.integers(1, 5000, size))
    together = predict(table, index, gpus, nodes, cache, io, batch)
    for k in range(0, size, 17):
        alone = predict_one(table.models[index[k]], gpus[k], nodes[k], cache[k], io[k], batch[k])
        assert together.row(k) == pytest.approx(alone.row(0))


def test_row_has_the_proto_fields():
    from silod.v1 import estimator_pb2

    row = predict_one(JOB, 2).row(0)
    assert set(row) == set(estimator_pb2.Prediction.DESCRIPTOR.fields_by_name)
    estimator_pb2.Prediction(**row)  # types fit the message


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"gpus": -1}, "gpus"),
        ({"gpus": 1.5}, "gpus"),
        ({"gpus": 2, "nodes": 3}, "nodes"),
        ({"cache_bytes": -5}, "cache_bytes"),
        ({"remote_io_bytes_per_s": float("nan")}, "remote_io_bytes_per_s"),
        ({"batch_size": -1}, "batch_size"),
    ],
)
def test_bad_candidates_name_the_field(kwargs, field):
    args = {"gpus": 1, "nodes": 0, "cache_bytes": 0, "remote_io_bytes_per_s": 0, "batch_size": 0, **kwargs}
    with pytest.raises(ValueError, match=field):
        predict_one(JOB, **args)


def test_unknown_model_index():
    with pytest.raises(ValueError, match="model_index"):
        predict([JOB], [0, 1], 1, 0, 0, 0)


def test_job_model_params_round_trip():
    model = JobModel.from_profile("cifar10")
    params = model.to_params()
    assert all(key.rsplit(".", 1)[0] in {"perf", "grad", "batch", "dataset"} for key in params)
    assert JobModel.from_params("cifar10", params) == model
    # Missing keys come from the profile; unknown keys are ignored.
    partial = {"perf.alpha_c_s": 0.5, "obs.0.step_time_s": 1.0}
    assert JobModel.from_params("cifar10", partial).perf.alpha_c == 0.5
    with pytest.raises(ValueError, match="perf.beta_c_s_per_sample"):
        JobModel.from_params("unknown-app", {"perf.alpha_c_s": 0.5})


def test_job_model_from_profile_carries_the_dataset():
    model = JobModel.from_profile("imagenet")
    assert model.dataset_bytes == 146e9 and model.bytes_per_sample == 114e3
    mine = model.with_dataset(dataset_bytes=1e9)
    assert mine.dataset_bytes == 1e9 and mine.bytes_per_sample == 114e3
    assert model.with_dataset(0, 0) == model


def test_job_model_rejects_bad_params():
    with pytest.raises(ValueError):
        JobModel("x", JOB.perf._replace(gamma=0.5), JOB.grad, JOB.bounds, 1, 1)
    with pytest.raises(ValueError):
        JobModel("x", JOB.perf, JOB.grad, JOB.bounds._replace(init_batch_size=0), 1, 1)


def test_profile_models_predict_sensibly_for_every_application():
    from estimator.profiles import application_names

    models = [JobModel.from_profile(app) for app in application_names()]
    table = ModelTable(models)
    index = np.repeat(np.arange(len(models)), 4)
    gpus = np.tile([1, 4, 16, 64], len(models))
    p = predict(table, index, gpus, 0, table.dataset_bytes[index], 0)
    assert np.all(p.goodput_samples_per_s > 0)
    np.testing.assert_allclose(p.speedup[gpus == 1], 1.0)
    assert np.all(sm.hit_ratio(table.dataset_bytes[index], table.dataset_bytes[index]) == p.hit_ratio)


def test_ten_thousand_candidates_in_one_call():
    # Speed is measured by benchmarks/estimator_predict.py; here only shape and sanity.
    table = ModelTable([JOB, JobModel.from_profile("ncf")])
    size = 10_000
    rng = np.random.default_rng(0)
    index = rng.integers(0, 2, size)
    gpus = rng.integers(0, 65, size)
    p = predict(table, index, gpus, 0, rng.uniform(0, 1e9, size), rng.uniform(0, 1e9, size))
    assert len(p) == size
    assert np.all(p.throughput_samples_per_s <= p.compute_samples_per_s)
    assert np.all((p.statistical_efficiency >= 0) & (p.statistical_efficiency <= 1))
