"""Tiresias: discretized 2D-LAS queues, FIFO within a queue, demotion, preemption, starvation promotion."""

from __future__ import annotations

import pytest

from scheduler.policies.tiresias import POLLUX_ARTIFACT_THRESHOLD_GPU_S, TiresiasPolicy
from scheduler.registry import get_policy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, running


def schedule(snapshot, **options):
    plan = get_policy("tiresias", **options).schedule(snapshot)
    assert_sound(snapshot, plan, rigid=True)
    return plan


def test_defaults_follow_the_pollux_artifact():
    policy = TiresiasPolicy()
    assert policy.thresholds_gpu_s == (POLLUX_ARTIFACT_THRESHOLD_GPU_S,) == (57_600.0,)
    assert policy.starvation_factor == 0.0


def test_queues_by_attained_gpu_seconds():
    policy = TiresiasPolicy(thresholds_gpu_s=(3250, 7200))
    queue = lambda attained: policy.queue(make_job("j", gpus=2, attained_gpu_s=attained), 0.0)  # noqa: E731
    assert [queue(a) for a in (0, 3249.9, 3250, 7199, 7200, 1e9)] == [0, 0, 1, 1, 2, 2]


def test_fifo_within_a_queue_regardless_of_size_or_length():
    jobs = [make_job("second", gpus=1, remaining=1e3, submit=5), make_job("first", gpus=2, remaining=1e9, submit=1)]
    assert running(schedule(make_snapshot(make_nodes(1, 2), jobs, time=10))) == {"first"}


def test_a_job_is_demoted_past_its_threshold_and_a_new_job_preempts_it():
    threshold = 3250.0
    new = make_job("new", gpus=2, submit=100)
    below = make_job("old", gpus=2, attained_gpu_s=threshold - 1)
    snap = make_snapshot(make_nodes(1, 2), [below, new], time=120, current={"old": [("n0", (0, 1))]})
    assert running(schedule(snap, thresholds_gpu_s=(threshold,))) == {"old"}  # same queue: FIFO, keeps running
    demoted = make_job("old", gpus=2, attained_gpu_s=threshold)
    snap = make_snapshot(make_nodes(1, 2), [demoted, new], time=120, current={"old": [("n0", (0, 1))]})
    plan = schedule(snap, thresholds_gpu_s=(threshold,))
    assert running(plan) == {"new"} and plan.get("new").placement == (("n0", (0, 1)),)


def test_lower_queues_run_on_what_higher_queues_leave():
    jobs = [make_job("demoted", gpus=1, attained_gpu_s=1e6), make_job("fresh", gpus=3, submit=5)]
    assert running(schedule(make_snapshot(make_nodes(1, 4), jobs, time=10))) == {"demoted", "fresh"}


def test_gang_scheduled_with_backfill():
    jobs = [make_job("big", gpus=4, submit=0), make_job("mid", gpus=3, submit=1), make_job("small", gpus=1, submit=2)]
    snap = make_snapshot(make_nodes(1, 5), jobs, time=3)
    plan = schedule(snap)
    assert running(plan) == {"big", "small"} and plan.gpus_of("big") == 4


def test_starvation_promotion():
    # The demoted job ran 100 s on 2 GPUs (200 GPU-s) and has waited 1000 - 100 = 900 s since arriving.
    # Both are past the threshold; the runner's priority puts it first in their queue, so only
    # a promotion lets the starved job in.
    starved = make_job("starved", gpus=2, attained_gpu_s=200.0, submit=0)
    runner = make_job("runner", gpus=2, attained_gpu_s=300.0, submit=10, priority=5)
    snap = make_snapshot(make_nodes(1, 2), [starved, runner], time=1000, current={"runner": [("n0", (0, 1))]})
    options = {"thresholds_gpu_s": (100.0,)}
    assert running(schedule(snap, **options)) == {"runner"}
    assert running(schedule(snap, **options, starvation_factor=8.0)) == {"starved"}  # 900 >= 8 x 100
    assert running(schedule(snap, **options, starvation_factor=10.0)) == {"runner"}  # 900 < 10 x 100
    policy = TiresiasPolicy(thresholds_gpu_s=(100.0,), starvation_factor=8.0)
    assert policy.queue(starved, 1000) == 0 and policy.queue(starved, 800) == 1


def test_never_run_jobs_are_not_promoted_they_are_already_on_top():
    policy = TiresiasPolicy(thresholds_gpu_s=(100.0,), starvation_factor=1.0)
    assert policy.queue(make_job("j", submit=0), 1e6) == 0


@pytest.mark.parametrize("options", [{"thresholds_gpu_s": (0.0,)}, {"thresholds_gpu_s": (200.0, 100.0)}, {"thresholds_gpu_s": (5.0, 5.0)}, {"starvation_factor": -1.0}])
def test_rejects_bad_options(options):
    with pytest.raises(ValueError):
        TiresiasPolicy(**options)


def test_single_queue_is_plain_fifo_with_backfill():
    jobs = [make_job("a", gpus=2, attained_gpu_s=1e9, submit=0), make_job("b", gpus=2, submit=1)]
    assert running(schedule(make_snapshot(make_nodes(1, 2), jobs, time=2), thresholds_gpu_s=())) == {"a"}
