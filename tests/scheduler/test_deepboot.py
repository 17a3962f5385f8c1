"""deepboot (ATS-T): power mean of restart-penalized speedups over training + lendable inference GPUs."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.deepboot.costs import MIN_KEPT_SHARE, ResizeCosts, kept_share
from scheduler.deepboot.lending import busy_gpus, lendable_gpus, place_lending, training_capacity
from scheduler.invariants import check_plan
from scheduler.policies.deepboot import DeepBootPolicy
from scheduler.policies.pollux_estimates import JobTable
from scheduler.registry import get_policy
from tests.scheduler.conftest import make_job, make_nodes, make_snapshot, model, snapshots


def elastic(job_id, application="cifar10", *, low=1, high=8, **fields):
    return make_job(job_id, application, gpus=low, min_gpus=low, max_gpus=high, **fields)


def mixed_cluster(training=1, inference=1, gpus=4):
    return make_nodes(training, gpus) + make_nodes(inference, gpus, pool="inference")


def test_registered_and_options_checked():
    policy = get_policy("deepboot", afe=False, full_restart_s={"bert": 50.0})
    assert isinstance(policy, DeepBootPolicy) and policy.name == "deepboot" and not policy.afe
    for bad in ({"penalty_rounds": 0.0}, {"max_gpus_per_job": 0}, {"full_restart_s": {"bert": -1.0}}, {"solver": "x"}):
        with pytest.raises(ValueError):
            DeepBootPolicy(**bad)


# -- resize costs --------------------------------------------------------------------------


def test_resize_costs_follow_the_artifact_tables_and_overrides():
    bert = make_job("b1", "bert")
    costs = ResizeCosts()
    assert costs.cost_s(bert, starting=True, default_s=30.0) == 103.0   # a start is always a full start
    assert costs.cost_s(bert, starting=False, default_s=30.0) == 5.0    # AFE resize
    assert ResizeCosts(afe=False).cost_s(bert, starting=False, default_s=30.0) == 103.0
    override = ResizeCosts(full_s={"b1": 7.0, "bert": 9.0}, afe_s={"bert": 0.5})
    assert override.cost_s(bert, starting=True, default_s=30.0) == 7.0   # job id before application
    assert override.cost_s(bert, starting=False, default_s=30.0) == 0.5
    unknown = make_job("x", model=dataclasses.replace(model("cifar10"), application="other"))
    assert costs.cost_s(unknown, starting=True, default_s=42.0) == 42.0  # not in the tables: the snapshot's cost


def test_kept_share():
    assert kept_share(24.0, 120.0, starting=False) == pytest.approx(0.8)      # (120 - 24) / 120
    assert kept_share(130.0, 120.0, starting=False) == 0.0
    assert kept_share(130.0, 120.0, starting=True) == MIN_KEPT_SHARE         # a start never looks worthless
    assert kept_share(130.0, 0.0, starting=False) == 1.0                      # no horizon, nothing lost


# -- lendable GPUs -------------------------------------------------------------------------


def test_only_free_and_sleeping_inference_gpus_are_lendable():
    nodes = mixed_cluster(1, 2)  # n0, i0, i1: 4 GPUs each
    snap = make_snapshot(nodes, [], inference_busy={"i0": (0, 2), "i1": (0, 1, 2, 3), "ghost": (0,), "n0": (1,)})
    assert busy_gpus(snap) == {"i0": (0, 2), "i1": (0, 1, 2, 3)}   # unknown and training nodes ignored
    assert lendable_gpus(snap) == {"i0": (1, 3)}
    assert training_capacity(snap) == 4 + 2
    assert training_capacity(snap, lend=False) == 4


def test_placement_prefers_the_training_pool_and_avoids_busy_gpus():
    nodes = mixed_cluster(1, 1)
    jobs = [make_job("small", gpus=2), make_job("big", gpus=5)]
    snap = make_snapshot(nodes, jobs, inference_busy={"i0": (0,)})
    result = place_lending(snap, {"big": 5, "small": 2}, ["small", "big"])
    # small fits on n0; big gets the rest of n0 (2) and the three idle GPUs of i0, never i0:0.
    assert result.placements["small"] == (("n0", (0, 1)),)
    assert result.placements["big"] == (("i0", (1, 2, 3)), ("n0", (2, 3)))
    assert place_lending(snap, {"big": 5}, lend=False).unplaced == ("big",)


def test_a_shrinking_job_gives_lent_gpus_back_first():
    nodes = mixed_cluster(1, 1)
    job = elastic("a", high=8)
    # a holds 1 GPU of n0 and 3 lent GPUs of i0; shrunk to 2 it keeps n0:0 and one of i0.
    snap = make_snapshot(nodes, [job], current={"a": [("n0", (0,)), ("i0", (0, 1, 2))]})
    assert place_lending(snap, {"a": 2}).placements["a"] == (("i0", (0,)), ("n0", (0,)))
    assert place_lending(snap, {"a": 1}).placements["a"] == (("n0", (0,)),)


def test_a_job_on_a_now_busy_gpu_cannot_stay():
    nodes = mixed_cluster(1, 1)
    job = elastic("a", high=4)
    snap = make_snapshot(nodes, [job], current={"a": [("i0", (0, 1))]}, inference_busy={"i0": (1,)})
    table = DeepBootPolicy().count_table(snap)
    assert table.held.tolist() == [0]  # priced as a restart, not a stay
    plan = DeepBootPolicy().schedule(snap)
    assert all(not (node == "i0" and 1 in ix) for node, ix in plan.get("a").placement)


# -- the objective ---------------------------------------------------------------------------


def test_speedups_are_penalized_by_the_resize_cost_except_where_the_job_stays():
    nodes = mixed_cluster(2, 0)
    jobs = [elastic("new", submit=0.0), elastic("run", submit=1.0)]
    snap = make_snapshot(nodes, jobs, current={"run": [("n0", (0, 1))]}, interval_s=60.0)
    literal = DeepBootPolicy(p=1.0, resize_penalty_rounds=0.0)  # DeepBoot's own objective: the sum of speedups
    table = literal.count_table(snap)
    speedup = JobTable(table.jobs).predict(np.zeros(8, dtype=int), np.arange(1, 9), 0, per_node=4).speedup
    # Tie-break bonus 1e-6 x (1 - rank / jobs): "new" ranks first (same attained service, earlier).
    new, run = table.utility[0, 1:] - 1e-6, table.utility[1, 1:] - 0.5e-6
    # new: a full cifar10 start, 24 s of the next 2 x 60 s: kept (120 - 24) / 120 = 0.8.
    assert new == pytest.approx(0.8 * speedup, rel=1e-9)
    # run: stays at 2 for free; any other count is an AFE resize of 3 s: kept 117 / 120.
    assert run[1] == pytest.approx(speedup[1], rel=1e-9)
    others = [c for c in range(8) if c != 1]
    assert run[others] == pytest.approx(117 / 120 * speedup[others], rel=1e-9)
    assert speedup[0] == pytest.approx(1.0)  # speedup is relative to one GPU
    # Without AFE a resize is a full cifar10 restart, 24 s: kept 96 / 120; staying is still free.
    slow = DeepBootPolicy(afe=False, p=1.0, resize_penalty_rounds=0.0).count_table(snap).utility[1, 1:] - 0.5e-6
    assert slow[1] == pytest.approx(speedup[1], rel=1e-9)
    assert slow[others] == pytest.approx(96 / 120 * speedup[others], rel=1e-9)
    # resize_penalty_rounds x interval_s is priced on top of a running job's AFE resize (3 + 30 s), not on a start.
    sticky = DeepBootPolicy(p=1.0, resize_penalty_rounds=0.5).count_table(snap).utility - table.utility
    assert sticky[0] == pytest.approx(0.0, abs=1e-12)
    assert (table.utility[1, 1:] + sticky[1, 1:] - 0.5e-6)[others] == pytest.approx(87 / 120 * speedup[others], rel=1e-9)
    assert sticky[1, 2] == pytest.approx(0.0, abs=1e-12)


def test_power_mean_exponent_transforms_each_term_like_pollux():
    from scheduler.policies.pollux import PolluxPolicy

    nodes = mixed_cluster(2, 0)
    jobs = [elastic("new", submit=0.0), elastic("run", submit=1.0)]
    snap = make_snapshot(nodes, jobs, current={"run": [("n0", (0, 1))]}, interval_s=60.0)
    base = DeepBootPolicy(p=1.0).count_table(snap).utility
    penalized = base.copy()
    penalized[0, 1:] -= 1e-6
    penalized[1, 1:] -= 0.5e-6
    for p in (-1.0, 0.0, 0.5):
        table = DeepBootPolicy(p=p).count_table(snap)
        expected = PolluxPolicy(p=p).utility(penalized)  # -(s + 1e-3)^-1, log(s + 1e-3), (s + 1e-3)^0.5
        expected[:, 1:] += np.array([1e-6, 0.5e-6])[:, None]
        assert table.utility == pytest.approx(expected, rel=1e-9)
    # p = -1 is the fairer choice: two GPUs for two jobs go one each even where the sum would not.
    utility = np.array([[0.0, 1.0, 2.0], [0.0, 0.1, 0.15]])
    from scheduler.policies.deepboot import CountTable

    fair = DeepBootPolicy(p=-1.0)
    table = CountTable((), 2, 4, np.zeros(2, dtype=int), fair.utility(utility), None)
    assert fair.choose_counts(table).tolist() == [1, 1]
    assert DeepBootPolicy(p=1.0).choose_counts(CountTable((), 2, 4, np.zeros(2, dtype=int), utility, None)).tolist() == [2, 0]
    for bad in ({"p": float("nan")}, {"floor": 0.0}, {"resize_penalty_rounds": -1.0}):
        with pytest.raises(ValueError):
            DeepBootPolicy(**bad)


def test_group_knapsack_by_hand():
    # Two jobs, two GPUs: (1, 1) gives 1.0 + 0.8 = 1.8, better than (2, 0) = 1.5 or (0, 2) = 1.7.
    from scheduler.policies.deepboot import CountTable

    utility = np.array([[0.0, 1.0, 1.5], [0.0, 0.8, 1.7]])
    table = CountTable((), 2, 4, np.zeros(2, dtype=int), utility, None)
    assert DeepBootPolicy().choose_counts(table).tolist() == [1, 1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_group_knapsack_matches_brute_force(data):
    n = data.draw(st.integers(1, 4))
    capacity = data.draw(st.integers(1, 6))
    jobs = [
        elastic(f"j{k}", data.draw(st.sampled_from(["cifar10", "bert", "imagenet", "ncf"])),
                low=(low := data.draw(st.integers(1, 3))), high=data.draw(st.integers(low, 6)), submit=float(k))
        for k in range(n)
    ]
    snap = make_snapshot(make_nodes(1, capacity), jobs, interval_s=60.0)
    policy = DeepBootPolicy(p=data.draw(st.sampled_from([1.0, 0.0, -1.0])))
    table = policy.count_table(snap)
    counts = policy.choose_counts(table)
    width = table.utility.shape[1]
    best = max(
        sum(table.utility[j, c] for j, c in enumerate(combo))
        for combo in itertools.product(range(width), repeat=n)
        if sum(combo) <= capacity
    )
    assert sum(counts) <= capacity
    assert sum(table.utility[j, c] for j, c in enumerate(counts)) == pytest.approx(best, abs=1e-12)
    # The large-cluster fallback is feasible and never beats the exact answer.
    greedy = dataclasses.replace(policy, solver="greedy").choose_counts(table)
    assert sum(greedy) <= capacity
    assert sum(table.utility[j, c] for j, c in enumerate(greedy)) <= best + 1e-12


def test_lent_gpus_serve_training_only_when_lending_is_on():
    nodes = mixed_cluster(1, 1)
    jobs = [elastic("a", high=8)]
    snap = make_snapshot(nodes, jobs, inference_busy={"i0": (3,)})
    lent = DeepBootPolicy().schedule(snap)
    # cifar10 keeps gaining from GPUs up to 7 here, so it takes n0's 4 and i0's 3 idle ones.
    assert lent.get("a").gpus_by_node == {"n0": 4, "i0": 3}
    alone = DeepBootPolicy(lend=False).schedule(snap)
    assert alone.get("a").gpus_by_node == {"n0": 4}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=snapshots(max_nodes=3, max_jobs=6), data=st.data())
def test_plans_never_use_busy_inference_gpus(snapshot, data):
    busy = {}
    for node in snapshot.nodes:
        if node.pool == "inference":
            busy[node.name] = tuple(i for i in range(node.gpus) if data.draw(st.booleans()))
    snap = dataclasses.replace(snapshot, inference_busy=busy)
    plan = DeepBootPolicy().schedule(snap)
    check_plan(snap, plan)  # no GPU twice, bounds honoured
    for allocation in plan.allocations.values():
        for node, indices in allocation.placement:
            assert not set(indices) & set(busy.get(node, ()))
    assert sum(a.gpus for a in plan.allocations.values()) <= training_capacity(snap)


def test_a_growing_job_keeps_its_gpus_and_adds_workers():
    """AFE scale-out: the job's current GPUs stay in its placement (a fresh placement would restart every worker)."""
    from scheduler.deepboot.lending import place_lending
    from scheduler.policy import Allocation, Plan
    from tests.scheduler.conftest import make_job, make_nodes, make_snapshot

    nodes = make_nodes(2, 4) + make_nodes(1, 4, pool="inference")
    names = [n.name for n in nodes]
    jobs = [make_job("grow", "cifar10", gpus=2, min_gpus=1, max_gpus=8), make_job("other", "ncf", gpus=2, min_gpus=1, max_gpus=8)]
    current = Plan({"grow": Allocation(placement=((names[0], (0, 1)),)), "other": Allocation(placement=((names[0], (2, 3)),))})
    for lend in (True, False):
        snapshot = make_snapshot(nodes, jobs, current=current)
        placed = place_lending(snapshot, {"grow": 4, "other": 2}, lend=lend).placements
        gpus = {(n, i) for n, ix in placed["grow"] for i in ix}
        assert {(names[0], 0), (names[0], 1)} <= gpus and len(gpus) == 4, (lend, placed["grow"])
        assert placed["other"] == ((names[0], (2, 3)),)
        assert not gpus & {(n, i) for n, ix in placed["other"] for i in ix}
    # Lent GPUs only once the training pool is full: growing to 10 needs 2 of the inference node.
    snapshot = make_snapshot(nodes, jobs, current=current)
    placed = place_lending(snapshot, {"grow": 10, "other": 2}).placements
    assert dict(placed["grow"]) == {names[0]: (0, 1), names[1]: (0, 1, 2, 3), names[2]: (0, 1, 2, 3)}
