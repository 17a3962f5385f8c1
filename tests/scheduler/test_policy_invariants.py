"""check_plan catches every kind of violation; every registered policy returns sound plans, deterministically, without mutating its input."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import HealthCheck, given, settings

from scheduler.invariants import PlanViolation, check_plan, plan_problems
from scheduler.policy import Allocation, NodeInfo, Plan
from scheduler.registry import get_policy, policy_names
from tests.scheduler.conftest import allocation, assert_sound, make_job, make_nodes, make_snapshot, snapshots

# Policies that give every job job.requested GPUs or none (fifo keeps a running job's count).
RIGID = {"sjf", "tiresias", "themis"}


def cluster():
    nodes = (NodeInfo("n0", 4, cache_capacity_bytes=100.0), NodeInfo("n1", 2, cache_capacity_bytes=50.0))
    jobs = [make_job("a", gpus=2, min_gpus=1, max_gpus=2), make_job("b", gpus=1)]
    return make_snapshot(nodes, jobs, storage_bandwidth_bytes_per_s=1000.0)


def test_a_sound_plan_passes():
    snap = cluster()
    plan = Plan({
        "a": allocation(("n0", (0, 1)), cache_bytes={"n0": 60.0, "n1": 50.0}, remote_io_bytes_per_s=600.0),
        "b": allocation(("n0", (2,)), cache_bytes={"n0": 40.0}, remote_io_bytes_per_s=400.0, batch_size=64),
    })
    assert plan_problems(snap, plan) == []
    check_plan(snap, plan)
    check_plan(snap, Plan())
    check_plan(snap, Plan({"b": Allocation()}))  # holding nothing is fine, whatever the bounds


@pytest.mark.parametrize(
    ("allocations", "message"),
    [
        ({"ghost": allocation(("n0", (0,)))}, "ghost: not an active job"),
        ({"a": allocation(("n0", (0, 1, 2)))}, "a: 3 GPUs outside [1, 2]"),
        ({"b": allocation(("n9", (0,)))}, "b: unknown node n9"),
        ({"b": allocation(("n1", (2,)))}, "b: GPU n1:2 does not exist"),
        ({"b": allocation(("n1", (-1,)))}, "b: GPU n1:-1 does not exist"),
        ({"a": allocation(("n0", (0, 1))), "b": allocation(("n0", (1,)))}, "b: GPU n0:1 already held by a"),
        ({"a": Allocation(placement=(("n0", (0,)), ("n0", (0,))))}, "a: GPU n0:0 already held by a"),
        ({"a": allocation(("n0", (0,)), cache_bytes={"n0": 80.0}), "b": allocation(("n0", (1,)), cache_bytes={"n0": 30.0})}, "node n0: cache quotas 110 B exceed capacity 100 B"),
        ({"a": allocation(("n0", (0,)), cache_bytes={"n0": -1.0})}, "a: negative or NaN cache quota on n0"),
        ({"a": allocation(("n0", (0,)), cache_bytes={"n0": math.nan})}, "a: negative or NaN cache quota on n0"),
        ({"a": allocation(("n0", (0,)), cache_bytes={"n7": 1.0})}, "cache quota on unknown node n7"),
        ({"a": allocation(("n0", (0,)), remote_io_bytes_per_s=-5.0)}, "a: negative or NaN remote IO rate"),
        ({"a": allocation(("n0", (0,)), remote_io_bytes_per_s=math.nan)}, "a: negative or NaN remote IO rate"),
        ({"a": allocation(("n0", (0,)), remote_io_bytes_per_s=900.0), "b": allocation(("n1", (0,)), remote_io_bytes_per_s=200.0)}, "remote IO rates 1100 B/s exceed the storage budget 1000 B/s"),
        ({"a": allocation(("n0", (0,)), batch_size=-8)}, "a: negative batch size -8"),
    ],
)
def test_check_plan_catches(allocations, message):
    snap = cluster()
    plan = Plan(allocations)
    assert message in plan_problems(snap, plan)
    with pytest.raises(PlanViolation, match="^.*" + message.replace("[", r"\[").replace("]", r"\]")):
        check_plan(snap, plan)


def test_unmanaged_io_and_rounding_slack_pass():
    snap = cluster()
    plan = Plan({"a": allocation(("n0", (0,)), cache_bytes={"n0": 100.0 + 1e-5}), "b": allocation(("n0", (1,)))})
    assert plan_problems(snap, plan) == []  # UNLIMITED IO is not counted; cache within the tolerance


def test_every_problem_is_listed():
    snap = cluster()
    plan = Plan({"ghost": allocation(("n0", (0,))), "a": allocation(("n0", (0, 1, 2))), "b": allocation(("n0", (0,)))})
    problems = plan_problems(snap, plan)
    assert len(problems) == 3
    with pytest.raises(PlanViolation) as raised:
        check_plan(snap, plan)
    assert all(problem in str(raised.value) for problem in problems)


# ---------------------------------------------------------------------------------------
# Every registered policy (gavel and pollux join when their modules exist)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=snapshots(max_nodes=5, max_jobs=10))
def test_policy_plans_are_sound_deterministic_and_leave_the_snapshot_alone(name, snapshot):
    before = copy.deepcopy(snapshot)
    policy = get_policy(name)
    plan = policy.schedule(snapshot)
    assert snapshot == before, "schedule() mutated its snapshot"
    check_plan(snapshot, plan)  # no double booking, GPUs exist, min/max honoured, cache and IO within capacity
    jobs = {job.job_id: job for job in snapshot.jobs}
    for job_id, a in plan.allocations.items():
        assert a.gpus == 0 or jobs[job_id].min_gpus <= a.gpus <= jobs[job_id].max_gpus
    # Deterministic: again, with a fresh instance, and on an equal (deep-copied) snapshot.
    assert policy.schedule(snapshot) == plan
    assert get_policy(name).schedule(before) == plan
    if name in RIGID:
        assert_sound(snapshot, plan, rigid=True)
        training = {node.name for node in snapshot.nodes if node.pool == "training"}
        assert all(node in training for a in plan.allocations.values() for node, _ in a.placement)
    if name == "fifo":
        for job_id, a in plan.allocations.items():
            held = snapshot.current.gpus_of(job_id)
            assert a.gpus == (min(max(held, jobs[job_id].min_gpus), jobs[job_id].max_gpus) if held else jobs[job_id].requested)


@pytest.mark.parametrize("name", sorted(RIGID | {"fifo"}))
def test_rigid_policies_fill_an_idle_cluster(name):
    # Nothing running, jobs fit: a work-conserving queue policy runs them all.
    jobs = [make_job(f"j{k}", gpus=k % 4 + 1, submit=k, remaining=1e5 * (k + 1)) for k in range(6)]
    snap = make_snapshot(make_nodes(4, 4), jobs, time=10)
    plan = get_policy(name).schedule(snap)
    assert_sound(snap, plan, rigid=True)
    assert {job_id for job_id, a in plan.allocations.items() if a.gpus} == {job.job_id for job in jobs}


def test_all_expected_policies_are_registered():
    assert RIGID | {"fifo"} <= set(policy_names())
