"""scheduler.quotas: the guarantee, lending, reclaim within one round, GPU types, limits, the
cache/IO ceilings, and no change at all without quotas, for every registered policy."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.invariants import check_plan
from scheduler.policy import Allocation, NodeInfo, Plan
from scheduler.quotas import TenantQuota, bound_data, schedule, usage
from scheduler.registry import get_policy, policy_names
from tests.scheduler.conftest import make_job, make_nodes, make_snapshot, snapshots

POLICIES = policy_names()


def job(job_id, tenant, gpus=2, submit=0.0, **kw):
    return make_job(job_id, gpus=gpus, submit=submit, tenant=tenant, **kw)


def run(policy, snap):
    plan = schedule(policy, snap)
    check_plan(snap, plan)
    return plan


def step(policy, snap, plan):
    """The next round's snapshot: ``plan`` in force."""
    return dataclasses.replace(snap, current=Plan({j: a for j, a in plan.allocations.items() if a.gpus}))


@pytest.mark.parametrize("name", POLICIES)
def test_no_quotas_is_the_policys_own_plan(name):
    policy = get_policy(name)
    jobs = [job(f"j{k}", ("a", "b", "c")[k % 3], gpus=1 + k % 3, submit=float(k)) for k in range(9)]
    snap = make_snapshot(make_nodes(3, 4), jobs)
    assert schedule(policy, snap) == policy.schedule(snap)
    # Quota rows for tenants with no work change nothing either.
    idle = dataclasses.replace(snap, quotas={"z": TenantQuota(gpus={"": 8})})
    assert schedule(policy, idle) == policy.schedule(idle)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_meets_the_guarantee_and_lends_idle_quota(name):
    """Tenant a owns 8 of 12 GPUs. With no work of its own, b borrows everything; when a's demand
    returns, b is down to what a leaves within the very next round."""
    policy = get_policy(name)
    nodes = make_nodes(3, 4)
    quotas = {"a": TenantQuota(gpus={"": 8})}
    borrowers = [job(f"b{k}", "b", gpus=2, submit=float(k)) for k in range(6)]
    snap = make_snapshot(nodes, borrowers, quotas=quotas)
    plan = run(policy, snap)
    assert usage(snap, plan).get("b", 0) == 12  # lending: a's idle quota is used

    owner = [job(f"a{k}", "a", gpus=2, submit=100.0 + k) for k in range(4)]
    snap = dataclasses.replace(step(policy, snap, plan), jobs=tuple(borrowers + owner), time_s=100.0)
    plan = run(policy, snap)
    held = usage(snap, plan)
    assert held.get("a", 0) == 8, held  # the guarantee, in one round
    assert held.get("b", 0) <= 4
    preempted = [j.job_id for j in borrowers if snap.current.gpus_of(j.job_id) and not plan.gpus_of(j.job_id)]
    assert len(preempted) >= 4


def test_the_owner_takes_free_gpus_before_preempting():
    policy = get_policy("fifo")
    quotas = {"a": TenantQuota(gpus={"": 4})}
    b = job("b0", "b", gpus=4)
    snap = make_snapshot(make_nodes(2, 4), [b], quotas=quotas)
    snap = step(policy, snap, run(policy, snap))
    snap = dataclasses.replace(snap, jobs=(b, job("a0", "a", gpus=4, submit=5.0)))
    plan = run(policy, snap)
    assert plan.get("b0").placement == snap.current.get("b0").placement  # kept in place
    assert plan.gpus_of("a0") == 4


def test_demand_beyond_the_quota_borrows_and_is_preempted_by_the_other_owner():
    policy = get_policy("fifo")
    quotas = {"a": TenantQuota(gpus={"": 4}), "b": TenantQuota(gpus={"": 4})}
    a_jobs = [job(f"a{k}", "a", gpus=4, submit=float(k)) for k in range(2)]
    snap = make_snapshot(make_nodes(2, 4), a_jobs, quotas=quotas)
    plan = run(policy, snap)
    assert usage(snap, plan) == {"a": 8}  # a borrows b's idle 4
    snap = dataclasses.replace(step(policy, snap, plan), jobs=tuple(a_jobs) + (job("b0", "b", gpus=4, submit=9.0),))
    plan = run(policy, snap)
    assert usage(snap, plan) == {"a": 4, "b": 4}
    assert plan.gpus_of("a0") == 4 and plan.gpus_of("a1") == 0  # the borrowing (later) job goes


def test_per_gpu_type():
    nodes = (NodeInfo("v0", 4, gpu_type="v100"), NodeInfo("k0", 4, gpu_type="k80"))
    quotas = {"a": TenantQuota(gpus={"v100": 4})}
    policy = get_policy("fifo")
    b = [job("b0", "b", gpus=4, gpu_types=("v100",)), job("b1", "b", gpus=4, gpu_types=("k80",))]
    snap = make_snapshot(nodes, b, quotas=quotas)
    plan = run(policy, snap)
    assert plan.gpus_of("b0") == plan.gpus_of("b1") == 4
    snap = dataclasses.replace(step(policy, snap, plan), jobs=tuple(b) + (job("a0", "a", gpus=4, submit=3.0),))
    plan = run(policy, snap)
    assert plan.get("a0").placement[0][0] == "v0"  # its v100 share, reclaimed from b0
    assert plan.gpus_of("b0") == 0 and plan.gpus_of("b1") == 4  # the k80 borrower is not touched


def test_tenants_without_quota_share_the_unassigned_remainder():
    policy = get_policy("fifo")
    quotas = {"a": TenantQuota(gpus={"": 4})}
    jobs = [job("a0", "a", gpus=4), job("c0", "c", gpus=4, submit=1.0), job("c1", "c", gpus=4, submit=2.0)]
    snap = make_snapshot(make_nodes(2, 4), jobs, quotas=quotas)
    plan = run(policy, snap)
    assert usage(snap, plan) == {"a": 4, "c": 4}
    assert plan.gpus_of("c0") == 4  # the policy's own order in the remainder (FIFO)


def test_borrowing_limit():
    policy = get_policy("fifo")
    quotas = {"a": TenantQuota(gpus={"": 4}, borrowing_limit_gpus=2)}
    jobs = [job(f"a{k}", "a", gpus=2, submit=float(k)) for k in range(6)]
    snap = make_snapshot(make_nodes(3, 4), jobs, quotas=quotas)
    assert usage(snap, run(policy, snap)) == {"a": 6}


def test_lending_limit_keeps_part_of_an_idle_quota_free():
    policy = get_policy("fifo")
    quotas = {"a": TenantQuota(gpus={"": 8}, lending_limit_gpus=4)}
    jobs = [job(f"b{k}", "b", gpus=2, submit=float(k)) for k in range(6)]
    snap = make_snapshot(make_nodes(3, 4), jobs, quotas=quotas)
    assert usage(snap, run(policy, snap)) == {"b": 8}  # 12 GPUs, 4 of a's 8 kept unlent


def test_cache_and_io_ceilings():
    snap = make_snapshot(make_nodes(2, 4, cache_capacity_bytes=100.0), [job("a0", "a"), job("b0", "b")],
                         storage_bandwidth_bytes_per_s=1000.0,
                         quotas={"a": TenantQuota(cache_bytes=30.0, remote_io_share=0.25)})
    allocs = {
        "a0": Allocation(placement=(("n0", (0, 1)),), cache_bytes={"n0": 60.0}, remote_io_bytes_per_s=600.0),
        "b0": Allocation(placement=(("n1", (0, 1)),), cache_bytes={"n1": 80.0}, remote_io_bytes_per_s=400.0),
    }
    out = bound_data(snap, allocs)
    assert out["a0"].total_cache_bytes == 30.0 and out["a0"].remote_io_bytes_per_s == 250.0
    assert out["b0"] is allocs["b0"]


@pytest.mark.parametrize("name", ["pollux", "deepboot"])
def test_an_elastic_job_grows_onto_idle_quota_and_shrinks_when_the_owner_returns(name):
    policy = get_policy(name)
    quotas = {"a": TenantQuota(gpus={"": 8}), "c": TenantQuota(gpus={"": 4})}
    c = job("c0", "c", gpus=4, min_gpus=1, max_gpus=12, application="imagenet", batch_size=0)
    snap = make_snapshot(make_nodes(3, 4), [c], quotas=quotas)
    plan = run(policy, snap)
    assert plan.gpus_of("c0") > 4  # beyond its share of 4: a's idle 8 are lent to it
    owner = [job(f"a{k}", "a", gpus=4, submit=10.0 + k) for k in range(2)]
    snap = dataclasses.replace(step(policy, snap, plan), jobs=(c, *owner), time_s=10.0)
    plan = run(policy, snap)
    assert usage(snap, plan).get("a") == 8 and 1 <= plan.gpus_of("c0") <= 4


def test_the_co_design_grants_stay_within_a_tenants_ceilings():
    from scheduler.data_grants import grant

    nodes = make_nodes(2, 4, cache_capacity_bytes=50e9)
    jobs = [job("a0", "a", gpus=4, application="imagenet", dataset="imagenet"),
            job("b0", "b", gpus=4, application="imagenet", dataset="imagenet-copy", submit=1.0)]
    budget = 2e9
    snap = make_snapshot(nodes, jobs, storage_bandwidth_bytes_per_s=budget,
                         quotas={"a": TenantQuota(cache_bytes=10e9, remote_io_share=0.1)})
    placed = Plan({"a0": Allocation(placement=(("n0", (0, 1, 2, 3)),)), "b0": Allocation(placement=(("n1", (0, 1, 2, 3)),))})
    plan = grant("silod", snap, placed, placed, {"a0", "b0"}, policy_co_designs=False)
    check_plan(snap, plan)
    assert plan.get("a0").total_cache_bytes <= 10e9 and plan.get("a0").remote_io_bytes_per_s <= 0.1 * budget + 1e-6
    assert plan.get("b0").total_cache_bytes > 10e9  # b has no ceiling


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(snapshot=snapshots(max_nodes=4, max_jobs=8), data=st.data())
def test_random_quotas_give_sound_deterministic_plans(name, snapshot, data):
    """Any policy under random tenants and quotas (stale plans in force included): a sound plan,
    the same twice, and no tenant beyond its nominal share plus its borrowing limit."""
    tenants = ("a", "b", "c")
    jobs = tuple(dataclasses.replace(j, tenant=data.draw(st.sampled_from(tenants))) for j in snapshot.jobs)
    quotas = {t: TenantQuota(gpus={"": data.draw(st.integers(0, 12))},
                             borrowing_limit_gpus=data.draw(st.sampled_from([None, 0, 2])),
                             lending_limit_gpus=data.draw(st.sampled_from([None, 0, 3])))
              for t in tenants if data.draw(st.booleans())}
    snap = dataclasses.replace(snapshot, jobs=jobs, quotas=quotas)
    policy = get_policy(name)
    plan = schedule(policy, snap)
    check_plan(snap, plan)
    assert schedule(policy, snap) == plan
    held = usage(snap, Plan({j: a for j, a in plan.allocations.items()
                             if all(snap.node(n).pool == "training" for n, _ in a.placement)}))
    for tenant, quota in quotas.items():
        if quota.borrowing_limit_gpus is not None:
            assert held.get(tenant, 0) <= quota.nominal_gpus + quota.borrowing_limit_gpus
