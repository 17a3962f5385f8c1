"""Observe: reports in StepObservation form refit a job's model."""

import numpy as np
import pytest

from estimator.fitting import ObservationLog
from estimator.goodput import step_time
from estimator.job_model import JobModel
from estimator.observe import observe


def test_reports_pull_the_model_from_the_profile_to_the_job():
    model = JobModel.from_profile("cifar10")
    # This job's GPUs are twice as slow as the profile's; it runs 1-node and 2-node shapes
    # at several batch sizes.
    truth = model.perf._replace(alpha_c=model.perf.alpha_c * 2, beta_c=model.perf.beta_c * 2)
    gpus = np.array([1, 1, 4, 4, 8, 8])
    nodes = np.array([1, 1, 1, 1, 2, 2])
    batch = np.array([128, 512, 512, 2048, 1024, 4096])
    local = batch / gpus
    steps = step_time(truth, nodes, gpus, local)
    syncs = steps - (truth.alpha_c + truth.beta_c * local)
    log = ObservationLog()
    refit = observe(model, log, gpus, nodes, batch, steps, syncs, grad_sqr=[0, 2.0], grad_var=[0, 80.0])
    assert len(log) == 6
    predicted = step_time(refit.perf, nodes, gpus, local)
    np.testing.assert_allclose(predicted, steps, rtol=0.02)
    assert refit.grad == (2.0, 80.0) and refit.grad_reports == 1
    # The refitted model survives the metadata store.
    stored = {**refit.to_params(), **log.to_params()}
    again = JobModel.from_params("cifar10", stored)
    assert again == refit
    assert len(ObservationLog.from_params(stored)) == 6


def test_io_bound_reports_do_not_touch_step_times():
    model = JobModel.from_profile("imagenet")
    log = ObservationLog()
    refit = observe(model, log, 4, 1, 800, 100.0, 0.0, grad_sqr=1.0, grad_var=3.0, io_bound=True)
    assert len(log) == 0 and refit.perf == model.perf
    assert refit.grad == (1.0, 3.0)


def test_accumulation_is_inferred_from_the_batch_size():
    model = JobModel.from_profile("imagenet")  # max 200 samples per GPU
    log = ObservationLog()
    observe(model, log, 2, 1, 1000, 1.0, 0.1)
    assert list(log.entries) == [(1, 2, 167, 2)]  # 500 per GPU: 3 micro-batches of 167


@pytest.mark.parametrize("kwargs", [{"gpus": 0}, {"nodes": 3}, {"batch_size": 0}, {"step_time_s": 0.0}])
def test_impossible_reports_are_rejected(kwargs):
    args = {"gpus": 2, "nodes": 1, "batch_size": 64, "step_time_s": 0.5, **kwargs}
    with pytest.raises(ValueError):
        observe(JobModel.from_profile("bert"), ObservationLog(), **args)
