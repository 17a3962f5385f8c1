"""pollux and deepboot on typed clusters: type and count chosen together from goodput per type."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from estimator.gpu_types import typed_models
from scheduler.policies.typed_counts import assign_types
from scheduler.registry import get_policy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, model


def typed(nodes, gpu_type):
    return tuple(dataclasses.replace(n, gpu_type=gpu_type) for n in nodes)


NODES = typed(make_nodes(1, 4, prefix="k"), "k80") + typed(make_nodes(1, 4, prefix="v"), "v100")


def elastic(job_id, application, **fields):
    return make_job(job_id, application, gpus=2, min_gpus=1, max_gpus=8,
                    type_models=typed_models(model(application), ["k80", "v100"]), **fields)


def job_types(snapshot, plan):
    return {j: {snapshot.node(n).gpu_type for n, _ in a.placement} for j, a in plan.allocations.items()}


@pytest.mark.parametrize("name", ["pollux", "deepboot"])
def test_each_job_goes_where_its_goodput_gains_most(name):
    snap = make_snapshot(NODES, [elastic("resnet", "imagenet"), elastic("rec", "ncf", submit=1)])
    plan = get_policy(name).schedule(snap)
    assert_sound(snap, plan)
    assert job_types(snap, plan) == {"resnet": {"v100"}, "rec": {"k80"}}
    assert {plan.get("resnet").gpu_type, plan.get("rec").gpu_type} == {"v100", "k80"}


@pytest.mark.parametrize("name", ["pollux", "deepboot"])
def test_crowded_typed_cluster_uses_every_gpu_one_type_per_job(name):
    apps = ["imagenet", "cifar10", "bert", "deepspeech2", "ncf", "yolov3"]
    snap = make_snapshot(NODES, [elastic(f"j{k}", app, submit=k) for k, app in enumerate(apps)])
    plan = get_policy(name).schedule(snap)
    assert_sound(snap, plan)
    assert all(len(t) == 1 for t in job_types(snap, plan).values())
    assert sum(a.gpus for a in plan.allocations.values()) == 8
    assert len(plan.allocations) == 6  # p = -1: every job gets its first GPU before any gets a second


def test_assign_types_moves_jobs_off_a_full_type():
    # Three identical jobs, each worth 2 on type 0 and 1 on type 1 per GPU-use, one GPU per type
    # used at most... type 0 holds 1 GPU, type 1 holds 2: the best total puts one job on type 0.
    u0 = np.array([[0.0, 2.0]] * 3)
    u1 = np.array([[0.0, 1.0]] * 3)
    solve = lambda u, cap: np.where(np.arange(u.shape[0]) < cap, 1, 0)  # noqa: E731  (first `cap` jobs get one GPU)
    assign, counts = assign_types([u0, u1], [1, 2], solve, np.zeros(3, dtype=np.int64))
    assert counts.tolist() == [1, 1, 1] and sorted(assign.tolist()) == [0, 1, 1]


@pytest.mark.parametrize("name", ["pollux", "deepboot", "gavel"])
def test_the_type_blind_baseline_keeps_one_type_per_job_but_ignores_speed(name):
    apps = ["imagenet", "cifar10", "bert", "deepspeech2"]
    snap = make_snapshot(NODES, [elastic(f"j{k}", app, submit=k) for k, app in enumerate(apps)])
    plan = get_policy(name, heterogeneity_aware=False).schedule(snap)
    assert_sound(snap, plan)
    assert all(len(t) == 1 for t in job_types(snap, plan).values())
    assert sum(a.gpus for a in plan.allocations.values()) == 8
