"""The live scheduler on typed nodes: the same placement rule and policies as the simulator."""

from __future__ import annotations

import pytest

from silod.v1 import plan_pb2


def _entry(plan: plan_pb2.AllocationPlan, job_id: str) -> plan_pb2.JobAllocation:
    return next(j for j in plan.jobs if j.job_id == job_id)


def _nodes(plan: plan_pb2.AllocationPlan, job_id: str) -> set[str]:
    return {p.node for p in _entry(plan, job_id).placements if p.gpu_indices}


@pytest.mark.parametrize("policy", ["fifo", "gavel", "pollux"])
def test_jobs_go_to_the_type_they_gain_most_on_and_respect_their_constraints(make_cluster, policy) -> None:
    cluster = make_cluster(policy=policy)
    cluster.add_node("k80-0", gpus=4, gpu_type="k80")
    cluster.add_node("v100-0", gpus=4, gpu_type="v100")
    resnet = cluster.submit("resnet", min_gpus=4, max_gpus=4, application="imagenet", batch_size=200)
    old = cluster.submit("old-only", min_gpus=2, max_gpus=2, gpu_types=["k80"])
    plan = cluster.round()
    assert _nodes(plan, resnet.id) == {"v100-0"} and _entry(plan, resnet.id).gpu_type == "v100"
    assert _nodes(plan, old.id) == {"k80-0"} and _entry(plan, old.id).gpu_type == "k80"
    # A job wider than any one type waits rather than spanning types.
    wide = cluster.submit("wide", min_gpus=6, max_gpus=6)
    plan = cluster.round()
    assert not _nodes(plan, wide.id) and _entry(plan, wide.id).gpu_type == ""
