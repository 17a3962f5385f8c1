"""SiloD co-allocation: max-min IO, cache by efficiency, IO by remaining bytes, starved jobs, and
every policy's co-designed plans on random snapshots (quotas within node capacity, IO within
the budget and NICs)."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from estimator.predict import predict_one
from scheduler import codesign as co
from scheduler.invariants import check_plan, plan_problems
from scheduler.policy import NodeInfo, Plan
from scheduler.registry import get_policy, policy_names
from tests.scheduler.conftest import allocation, make_job, make_snapshot, model, snapshots

CODESIGNING = [name for name in policy_names() if "codesign" in {f.name for f in dataclasses.fields(get_policy(name))}]


def test_max_min_share_by_hand():
    inf = math.inf
    # Budget 120 over demands 10, 50, 100: 10 is met, the other two split the remaining 110
    # evenly (55 each) but 50 only needs 50, so the last gets 60.
    assert np.allclose(co.max_min_share([10, 50, 100], [{"a": 1}, {"a": 1}, {"b": 1}], 120, {"a": inf, "b": inf}), [10, 50, 60])
    # No budget, NICs of 40 (a) and 30 (b): the two jobs on a share 40 after the first takes its 10.
    assert np.allclose(co.max_min_share([10, 50, 100], [{"a": 1}, {"a": 1}, {"b": 1}], inf, {"a": 40, "b": 30}), [10, 30, 30])
    # A job split half/half over a and b uses both NICs: it gets 10 (5 on each); b then has
    # 25 left for job 2; a has 35 left for job 1.
    assert np.allclose(co.max_min_share([10, 50, 100], [{"a": .5, "b": .5}, {"a": 1}, {"b": 1}], inf, {"a": 40, "b": 30}), [10, 35, 25])
    assert np.allclose(co.max_min_share([0, 5], [{"a": 1}, {"a": 1}], 100, {}), [0, 5])  # no demand, no grant


def _two_jobs(capacity: float, budget: float):
    """A small, fast dataset (s=1000 B, d=1 MB) and a large one (s=1000 B, d=1 GB), one node each pair."""
    small = model("cifar10").with_dataset(1e6, 1000)
    large = model("cifar10").with_dataset(1e9, 1000)
    nodes = (NodeInfo("n0", 4, cache_capacity_bytes=capacity), NodeInfo("n1", 4, cache_capacity_bytes=capacity))
    jobs = [
        make_job("small", model=small, dataset="small", submit=0, target_samples=1e6),
        make_job("large", model=large, dataset="large", submit=1, target_samples=1e6),
    ]
    return make_snapshot(nodes, jobs, storage_bandwidth_bytes_per_s=budget)


def test_cache_goes_to_the_most_efficient_dataset_first_and_io_to_the_least_remaining_bytes():
    snap = _two_jobs(capacity=1.5e6, budget=1e5)
    both_on_n0 = {"small": (("n0", (0,)),), "large": (("n0", (1,)),)}
    plan = co.co_allocate(snap, both_on_n0, ["large", "small"])
    check_plan(snap, plan)
    # Efficiency T s / d: the 1 MB dataset saves 1000x more IO per cached byte; it is cached
    # whole (1 MB), the large one gets the remaining 0.5 MB of n0.
    assert plan.get("small").cache_bytes == {"n0": 1e6}
    assert plan.get("large").cache_bytes == {"n0": pytest.approx(0.5e6)}
    # Nothing is cached yet (snapshot.cached_bytes empty): both need T(1 GPU) * s of IO now.
    # "small" has 1e6 * 1000 * 0 (steady state fully cached) + 1e6 bytes of fill to read,
    # "large" 1e6 samples * 1000 B * (1 - 0.0005) + 0.5e6: small is served first.
    t = predict_one(model("cifar10"), 1, 1, 0, math.inf, model("cifar10").bounds.init_batch_size).compute_samples_per_s[0]
    demand = t * 1000.0
    assert demand > 1e5  # IO-bound: the budget cannot feed even one job at compute speed
    assert plan.get("small").remote_io_bytes_per_s == pytest.approx(1e5)
    assert plan.get("large").remote_io_bytes_per_s == 0.0
    # Once the small dataset is cached it needs no IO and the large job gets the budget.
    warm = dataclasses.replace(snap, cached_bytes={("n0", "small"): 1e6})
    plan = co.co_allocate(warm, both_on_n0, ["large", "small"])
    assert plan.get("small").remote_io_bytes_per_s == 0.0
    assert plan.get("large").remote_io_bytes_per_s == pytest.approx(1e5)
    # ... unless "small" cached those bytes itself in its current epoch (it read them before
    # they were cached): they are no hits for it yet, it needs T * s again and is served first.
    filling = dataclasses.replace(warm, fresh_bytes={("small", "n0"): 1e6})
    plan = co.co_allocate(filling, both_on_n0, ["large", "small"])
    assert plan.get("small").remote_io_bytes_per_s == pytest.approx(1e5)
    assert plan.get("large").remote_io_bytes_per_s == 0.0
    # Half of it fresh: half its samples miss, half the IO of all fresh (budget unlimited: grant = b*).
    unlimited = dataclasses.replace(filling, storage_bandwidth_bytes_per_s=math.inf)
    full = co.co_allocate(unlimited, both_on_n0, ["large", "small"]).get("small").remote_io_bytes_per_s
    half = dataclasses.replace(unlimited, fresh_bytes={("small", "n0"): 0.5e6})
    assert co.co_allocate(half, both_on_n0, ["large", "small"]).get("small").remote_io_bytes_per_s == pytest.approx(full / 2)


def test_priority_order_and_a_job_never_gets_more_than_its_dataset():
    snap = _two_jobs(capacity=5e9, budget=math.inf)
    plan = co.co_allocate(snap, {"small": (("n0", (0,)), ("n1", (0,)))}, io="priority")
    # 1 MB suffices over both nodes; each rank reads through its own node's cache, so the job's
    # two nodes get half each.
    assert plan.get("small").total_cache_bytes == pytest.approx(1e6)
    assert plan.get("small").cache_bytes == {"n0": pytest.approx(0.5e6), "n1": pytest.approx(0.5e6)}
    assert math.isinf(plan.get("small").remote_io_bytes_per_s) is False  # unlimited budget: the demand itself
    snap = _two_jobs(capacity=0.0, budget=3e5)
    placed = {"small": (("n0", (0,)),), "large": (("n1", (0,)),)}
    plan = co.co_allocate(snap, placed, ["large", "small"], io="priority")
    t = predict_one(model("cifar10"), 1, 1, 0, math.inf, model("cifar10").bounds.init_batch_size).compute_samples_per_s[0]
    assert plan.get("large").remote_io_bytes_per_s == pytest.approx(min(3e5, t * 1000))  # first in the policy's order
    assert plan.get("small").remote_io_bytes_per_s == pytest.approx(max(0.0, 3e5 - t * 1000))


def test_a_multi_node_job_gets_cache_on_every_node_then_where_there_is_room():
    # 3 GPUs on n0, 1 on n1: a quarter of the dataset on n1, three quarters on n0 ...
    snap = _two_jobs(capacity=5e9, budget=math.inf)
    placed = {"small": (("n0", (0, 1, 2)), ("n1", (0,)))}
    assert co.co_allocate(snap, placed).get("small").cache_bytes == {"n0": pytest.approx(0.75e6), "n1": pytest.approx(0.25e6)}
    # ... unless n1 has room for 0.1 MB only: n0 takes the rest in the second pass.
    nodes = (NodeInfo("n0", 4, cache_capacity_bytes=5e9), NodeInfo("n1", 4, cache_capacity_bytes=0.1e6))
    tight = dataclasses.replace(snap, nodes=nodes)
    assert co.co_allocate(tight, placed).get("small").cache_bytes == {"n0": pytest.approx(0.9e6), "n1": pytest.approx(0.1e6)}


def test_starved_jobs_are_re_admitted_out():
    snap = _two_jobs(capacity=0.0, budget=1e5)
    seen = []

    def admit(excluded):
        seen.append(excluded)
        return {j: ((f"n{k}", (0,)),) for k, j in enumerate(["small", "large"]) if j not in excluded}, ["small", "large"]

    plan = co.without_starved(snap, admit)
    # "small" has less left to read, takes the whole budget; "large" would get 0 and is dropped.
    assert seen == [frozenset(), frozenset({"large"})]
    assert set(plan.allocations) == {"small"}


def test_nic_invariant():
    nodes = (NodeInfo("n0", 2, nic_bytes_per_s=100.0), NodeInfo("n1", 2))
    snap = make_snapshot(nodes, [make_job("a", gpus=2), make_job("b")])
    spread = Plan({"a": allocation(("n0", (0,)), ("n1", (0,)), remote_io_bytes_per_s=150.0)})
    assert plan_problems(snap, spread) == []  # 75 B/s through n0's NIC
    both = Plan({**spread.allocations, "b": allocation(("n0", (1,)), remote_io_bytes_per_s=30.0)})
    assert "node n0: remote IO rates 105 B/s exceed its NIC 100 B/s" in plan_problems(snap, both)


def test_every_policy_has_a_codesign_option():
    assert {"fifo", "sjf", "tiresias", "themis", "gavel", "pollux"} <= set(CODESIGNING)


@pytest.mark.parametrize("name", CODESIGNING)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=snapshots(max_nodes=4, max_jobs=8))
def test_codesigned_plans_are_sound_and_deterministic(name, snapshot):
    snapshot = dataclasses.replace(snapshot, storage_bandwidth_bytes_per_s=5e7)
    before = copy.deepcopy(snapshot)
    policy = get_policy(name, codesign=True)
    plan = policy.schedule(snapshot)
    assert snapshot == before
    check_plan(snapshot, plan)  # quotas within node capacity, IO within the budget
    assert sum(a.remote_io_bytes_per_s for a in plan.allocations.values()) <= 5e7 * (1 + 1e-9)
    for job_id, a in plan.allocations.items():
        assert math.isfinite(a.remote_io_bytes_per_s)  # every co-designed grant is managed
        dataset = next(j for j in snapshot.jobs if j.job_id == job_id).model.dataset_bytes
        assert a.total_cache_bytes <= dataset * (1 + 1e-9)  # never more than the dataset
    assert get_policy(name, codesign=True).schedule(before) == plan


def test_gavel_codesign_grows_jobs_only_while_storage_has_slack():
    # Two elastic 1-GPU jobs on 8 GPUs; "large" (1 GB, uncacheable) needs more IO at its one
    # GPU than the 1e5 B/s budget: storage is the bottleneck and no job is offered more GPUs.
    snap = _two_jobs(capacity=2e6, budget=1e5)
    snap = dataclasses.replace(
        snap,
        jobs=tuple(dataclasses.replace(j, max_gpus=8) for j in snap.jobs),
        cached_bytes={("n0", "small"): 1e6, ("n1", "small"): 1e6},
    )
    bound = get_policy("gavel", codesign=True).solve(snap)
    assert bound.gpus[bound.fraction > 1e-6].max() == 1
    # With a budget that feeds both at their requested counts, elastic Gavel grows them.
    slack = get_policy("gavel", codesign=True).solve(dataclasses.replace(snap, storage_bandwidth_bytes_per_s=1e12))
    assert slack.gpus[slack.fraction > 1e-6].max() > 1


def test_an_unknown_io_order_is_refused_naming_it():
    with pytest.raises(ValueError, match="codesign_io"):
        get_policy("pollux", codesign=True, codesign_io="fast")
    snap = _two_jobs(capacity=0.0, budget=1e5)
    with pytest.raises(ValueError, match="io must be"):
        co.co_allocate(snap, {"small": (("n0", (0,)),)}, io="fast")  # type: ignore[arg-type]
