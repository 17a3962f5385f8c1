"""Every policy plans for a cluster with no nodes (none joined yet, or all lost): an empty plan,
not an exception that fails every round until a node comes. Found by the live benchmark, where
jobs are queued before the node fleet starts."""

from __future__ import annotations

import pytest

from estimator.job_model import JobModel
from scheduler.policy import ClusterSnapshot, JobInfo, Plan
from scheduler.registry import get_policy, policy_names


@pytest.mark.parametrize("name", policy_names())
def test_a_policy_plans_nothing_on_a_cluster_without_nodes(name: str) -> None:
    job = JobInfo(job_id="j", model=JobModel.from_profile("cifar10"), submit_time_s=0.0, min_gpus=1, max_gpus=1,
                  target_samples=1e6, requested_gpus=1)
    plan = get_policy(name).schedule(ClusterSnapshot(time_s=0.0, nodes=(), jobs=(job,), current=Plan()))
    assert plan.allocations == {}
