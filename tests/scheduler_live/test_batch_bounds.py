"""A goodput policy retunes a job's batch only within what the job's owner allows:
``batch_size`` is where it starts, ``max_batch_size`` (0: ``batch_size``) the most it may reach.
The application profile's own bounds (cifar10 accepts batches in the thousands) do not apply."""

from __future__ import annotations

import pytest

from estimator.job_model import JobModel
from scheduler.live.models import with_job_batch_bounds
from silod.v1 import common_pb2, plan_pb2


def _batch(plan: plan_pb2.AllocationPlan, job_id: str) -> int:
    return next(j for j in plan.jobs if j.job_id == job_id).batch_size


@pytest.mark.parametrize("policy", ["pollux", "deepboot"])
def test_goodput_policies_keep_each_jobs_batch_within_its_own_limits(make_cluster, policy) -> None:
    cluster = make_cluster(policy=policy)
    cluster.add_node("n1", gpus=4)
    cluster.add_node("n2", gpus=4)
    fixed = cluster.submit("fixed", min_gpus=1, max_gpus=4, batch_size=64)  # max_batch_size 0: stays at 64
    capped = cluster.submit("capped", min_gpus=1, max_gpus=4, batch_size=64, max_batch_size=256)
    plan = cluster.round()
    assert _batch(plan, fixed.id) == 64
    assert 64 <= _batch(plan, capped.id) <= 256


def test_a_profiles_noise_scale_survives_the_jobs_own_initial_batch() -> None:
    profile = JobModel.from_profile("cifar10")
    spec = common_pb2.JobSpec(batch_size=profile.bounds.init_batch_size * 4, max_batch_size=0)
    model = with_job_batch_bounds(profile, spec)
    assert model.bounds.init_batch_size == model.bounds.max_batch_size == spec.batch_size
    before = profile.bounds.init_batch_size * profile.grad.var / profile.grad.sqr
    after = model.bounds.init_batch_size * model.grad.var / model.grad.sqr
    assert after == pytest.approx(before)
    assert with_job_batch_bounds(profile, common_pb2.JobSpec()) is profile  # no batch given: the profile's
