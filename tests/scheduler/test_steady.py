"""Policies' promises (scheduler.steady): while a promise holds, the policy returns its plan again.

Every policy with ``stable_until`` is run on random snapshots: its plan is put in force, asked
again (so a fixed point can show), and asked how long that plan stands. Then time passes
within the promise, the jobs holding GPUs progress (by any amount, as a restart may stall
them) and gain their GPUs' worth of attained service, and the policy must return the same
plan; with ``departures`` also after some jobs have left.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.policy import ClusterSnapshot, Plan
from scheduler.registry import get_policy, policy_names
from scheduler.steady import NO_PROMISE, Steadiness, attained_order_change, threshold_crossing, unchanged
from tests.scheduler.conftest import allocation, make_job, make_nodes, make_snapshot, snapshots

PROMISING = [name for name in policy_names() if hasattr(get_policy(name), "stable_until")]


def test_every_policy_promises():
    assert set(PROMISING) >= {"fifo", "sjf", "tiresias", "themis", "gavel", "pollux", "deepboot"}


def later(snapshot: ClusterSnapshot, plan: Plan, until: float, draw) -> ClusterSnapshot:
    """``snapshot`` some time before ``until`` with ``plan`` in force and its jobs progressed."""
    span = min(until, snapshot.time_s + 1e6) - snapshot.time_s
    dt = span * draw(st.sampled_from([0.0, 0.01, 0.5, 0.999]))
    jobs = []
    for job in snapshot.jobs:
        gpus = plan.gpus_of(job.job_id)
        if gpus:
            share = draw(st.sampled_from([0.0, 0.001, 0.3, 1.0]))
            job = dataclasses.replace(job, attained_gpu_s=job.attained_gpu_s + gpus * dt,
                                      samples_done=job.samples_done + share * job.remaining_samples)
        jobs.append(job)
    return dataclasses.replace(snapshot, time_s=snapshot.time_s + dt, current=plan, jobs=tuple(jobs))


@pytest.mark.parametrize("name", PROMISING)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=snapshots(max_nodes=4, max_jobs=8), data=st.data())
def test_a_promised_plan_is_returned_again(name, snapshot, data):
    policy = get_policy(name)
    first = policy.schedule(snapshot)
    shown = dataclasses.replace(snapshot, current=first)  # the plan carried out
    plan = policy.schedule(shown)
    promise = policy.stable_until(shown, plan)
    assert isinstance(promise, Steadiness)
    if promise.until <= shown.time_s:
        return
    after = later(shown, plan, promise.until, data.draw)
    assert policy.schedule(after).allocations == plan.allocations, f"{name}: promised until {promise.until}"
    if promise.departures and after.jobs:
        gone = set(data.draw(st.lists(st.sampled_from([j.job_id for j in after.jobs]), max_size=3)))
        kept = Plan({j: a for j, a in plan.allocations.items() if j not in gone})
        fewer = dataclasses.replace(after, jobs=tuple(j for j in after.jobs if j.job_id not in gone), current=kept)
        assert policy.schedule(fewer).allocations == kept.allocations, f"{name}: departures of {sorted(gone)}"


def two_jobs(current: dict) -> ClusterSnapshot:
    jobs = [make_job("a", gpus=4, submit=0.0, attained_gpu_s=0.0), make_job("b", gpus=4, submit=1.0, attained_gpu_s=0.0)]
    return make_snapshot(make_nodes(1, 4), jobs, current=Plan(current), time=100.0)


def test_queue_policies_promise_forever_while_nobody_waits_and_react_to_contention():
    alone = make_snapshot(make_nodes(2, 4), [make_job("a", gpus=4), make_job("b", gpus=4)], time=10.0)
    for name in ("fifo", "sjf", "tiresias", "themis"):
        policy = get_policy(name)
        plan = policy.schedule(alone)
        assert policy.stable_until(alone, plan) == Steadiness(math.inf, departures=True), name
    crowded = two_jobs({"a": allocation(("n0", (0, 1, 2, 3)))})
    plan = get_policy("themis").schedule(crowded)
    assert get_policy("themis").stable_until(crowded, plan) == NO_PROMISE  # rho moves with the clock
    fifo = get_policy("fifo")
    assert fifo.stable_until(crowded, fifo.schedule(crowded)) == Steadiness(math.inf)  # b waits behind a, for ever


def test_tiresias_promises_until_the_next_threshold():
    policy = get_policy("tiresias", thresholds_gpu_s=(1000.0,))
    crowded = two_jobs({"a": allocation(("n0", (0, 1, 2, 3)))})
    plan = policy.schedule(crowded)
    assert unchanged(crowded, plan)
    until = policy.stable_until(crowded, plan).until
    assert until == pytest.approx(100.0 + 1000.0 / 4, abs=0.01) and until < 350.0  # a leaves queue 0 at 350 s
    assert threshold_crossing(crowded, plan, (1000.0,)) == until


def test_the_order_of_attained_service_changes_when_a_faster_job_catches_up():
    jobs = [make_job("a", gpus=4, attained_gpu_s=100.0), make_job("b", gpus=1, attained_gpu_s=200.0),
            make_job("c", gpus=1, attained_gpu_s=200.0, submit=5.0)]
    snapshot = make_snapshot(make_nodes(2, 4), jobs, time=0.0)
    plan = Plan({"a": allocation(("n0", (0, 1, 2, 3))), "b": allocation(("n1", (0,))), "c": allocation(("n1", (1,)))})
    assert attained_order_change(snapshot, plan) == pytest.approx(100.0 / 3, abs=0.01)  # a passes b at 33 s
    assert attained_order_change(snapshot, Plan({"c": plan.allocations["c"]})) == math.inf  # c, last, only moves away
    assert attained_order_change(snapshot, Plan({"b": plan.allocations["b"]})) < 0  # b passes c (tied, later) at once
