"""FIFO: arrival order, requested GPUs or none, no preemption, optional backfill, training pool only."""

from __future__ import annotations

from scheduler.registry import get_policy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, running


def schedule(snapshot, **options):
    plan = get_policy("fifo", **options).schedule(snapshot)
    assert_sound(snapshot, plan)
    return plan


def test_first_come_first_served():
    jobs = [make_job("late", gpus=4, submit=5), make_job("early", gpus=4, submit=1)]
    plan = schedule(make_snapshot(make_nodes(1, 4), jobs, time=10))
    assert running(plan) == {"early"}


def test_gives_the_requested_count_not_the_maximum():
    job = make_job("j", gpus=2, min_gpus=1, max_gpus=8)
    assert schedule(make_snapshot(make_nodes(2, 4), [job])).gpus_of("j") == 2
    # requested_gpus = 0 means the maximum.
    job = make_job("j", gpus=2, min_gpus=1, max_gpus=8, requested_gpus=0)
    assert schedule(make_snapshot(make_nodes(2, 4), [job])).gpus_of("j") == 8


def test_a_job_gets_its_whole_request_or_nothing():
    jobs = [make_job("a", gpus=3), make_job("b", gpus=3, min_gpus=1, max_gpus=3, submit=1)]
    plan = schedule(make_snapshot(make_nodes(1, 4), jobs))
    assert running(plan) == {"a"}  # b's 3 do not fit in the 1 left; it does not shrink to 1


def test_never_preempts_a_running_job():
    jobs = [make_job("first", gpus=4, submit=0), make_job("runner", gpus=4, submit=5)]
    snap = make_snapshot(make_nodes(1, 4), jobs, time=10, current={"runner": [("n0", range(4))]})
    plan = schedule(snap)
    assert running(plan) == {"runner"} and plan.get("runner").placement == (("n0", (0, 1, 2, 3)),)


def test_backfill_lets_later_small_jobs_use_what_the_head_cannot():
    jobs = [make_job("small0", gpus=2, submit=0), make_job("head", gpus=4, submit=1), make_job("small1", gpus=2, submit=2)]
    snap = make_snapshot(make_nodes(1, 4), jobs, time=3)
    assert running(schedule(snap)) == {"small0", "small1"}
    assert running(schedule(snap, backfill=False)) == {"small0"}


def test_uses_only_the_training_pool():
    nodes = make_nodes(1, 2) + make_nodes(1, 8, pool="inference")
    jobs = [make_job("a", gpus=2), make_job("b", gpus=4, submit=1)]
    plan = schedule(make_snapshot(nodes, jobs))
    assert running(plan) == {"a"} and plan.get("a").placement[0][0] == "n0"


def test_running_jobs_on_a_lost_node_move_if_there_is_room():
    jobs = [make_job("a", gpus=2)]
    snap = make_snapshot(make_nodes(1, 4), jobs, current={"a": [("gone", (0, 1))]})
    assert schedule(snap).get("a").placement == (("n0", (0, 1)),)


def test_empty_cluster_and_no_jobs():
    assert schedule(make_snapshot(make_nodes(1, 4), [])).allocations == {}
    assert schedule(make_snapshot((), [make_job("a")])).allocations == {}
