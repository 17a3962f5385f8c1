"""Per-rank CPU and memory requests: placement's filter and reserve, the invariant, every
policy, DeepBoot's lending, tenant quotas, the co-design's spreading and the elastic bound."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings

from scheduler.codesign import spread_for_cache
from scheduler.deepboot.lending import place_lending
from scheduler.invariants import check_plan, plan_problems
from scheduler.placement import place, plan_from_placements
from scheduler.policy import NodeInfo, Plan
from scheduler.quotas import TenantQuota, schedule as quota_schedule
from scheduler.rank_requests import NodeRoom, less_requested, within_reach
from scheduler.registry import get_policy, policy_names
from tests.scheduler.conftest import allocation, make_job, make_snapshot, snapshots

GiB = 2**30


def node_of(placement) -> set[str]:
    return {node for node, _ in placement}


# -- placement -----------------------------------------------------------------------------


def test_a_node_with_free_gpus_but_too_few_cores_is_passed_over():
    # n0 is the tightest fit for 4 GPUs, but it offers 4 cores and the job's ranks want 8.
    nodes = (NodeInfo("n0", 4, cpus=4), NodeInfo("n1", 8, cpus=64))
    snap = make_snapshot(nodes, [make_job("j", gpus=4, cpus_per_rank=2)])
    assert place(snap, {"j": 4}).placements["j"] == (("n1", (0, 1, 2, 3)),)


def test_a_node_with_free_gpus_but_too_little_memory_is_passed_over():
    nodes = (NodeInfo("n0", 4, memory_bytes=16 * GiB), NodeInfo("n1", 8, memory_bytes=256 * GiB))
    snap = make_snapshot(nodes, [make_job("j", gpus=2, memory_bytes_per_rank=10 * GiB)])
    assert node_of(place(snap, {"j": 2}).placements["j"]) == {"n1"}


def test_a_job_no_node_has_room_for_is_unplaced():
    nodes = (NodeInfo("n0", 8, cpus=4), NodeInfo("n1", 8, cpus=4))
    snap = make_snapshot(nodes, [make_job("j", gpus=1, cpus_per_rank=5)])
    result = place(snap, {"j": 1})
    assert result.placements == {} and result.unplaced == ("j",)


def test_ranks_spread_over_nodes_as_far_as_their_cores_allow():
    # 6 ranks of 4 cores: n0 holds 2 (8 cores), n1 holds 4 (16 cores), whatever their GPUs.
    nodes = (NodeInfo("n0", 8, cpus=8), NodeInfo("n1", 8, cpus=16))
    snap = make_snapshot(nodes, [make_job("j", gpus=6, cpus_per_rank=4)])
    placement = dict(place(snap, {"j": 6}).placements["j"])
    assert {node: len(ix) for node, ix in placement.items()} == {"n0": 2, "n1": 4}


def test_two_jobs_share_a_nodes_cores():
    nodes = (NodeInfo("n0", 8, cpus=12), NodeInfo("n1", 8, cpus=64))
    jobs = [make_job("a", gpus=2, cpus_per_rank=4), make_job("b", gpus=2, cpus_per_rank=4, submit=1)]
    result = place(make_snapshot(nodes, jobs), {"a": 2, "b": 2}, order=["a", "b"])
    # a takes 8 of n0's 12 cores; b's 8 no longer fit there, though n0 still has 6 free GPUs.
    assert node_of(result.placements["a"]) == {"n0"}
    assert node_of(result.placements["b"]) == {"n1"}


def test_fractional_cores_add_up_without_rounding_a_rank_out():
    snap = make_snapshot((NodeInfo("n0", 4, cpus=0.3),), [make_job("j", gpus=3, cpus_per_rank=0.1)])
    assert place(snap, {"j": 3}).placements["j"] == (("n0", (0, 1, 2)),)


def test_a_job_kept_where_it_runs_counts_against_the_nodes_cores():
    nodes = (NodeInfo("n0", 8, cpus=8), NodeInfo("n1", 8, cpus=64))
    jobs = [make_job("old", gpus=2, cpus_per_rank=3), make_job("new", gpus=1, cpus_per_rank=3, submit=1)]
    snap = make_snapshot(nodes, jobs, current={"old": [("n0", (0, 1))]})
    # "new" is placed first in order, but "old" keeps its place (and 6 of n0's 8 cores) first.
    result = place(snap, {"new": 1, "old": 2}, order=["new", "old"])
    assert result.placements["old"] == (("n0", (0, 1)),)
    assert node_of(result.placements["new"]) == {"n1"}


def test_a_running_job_whose_node_no_longer_has_its_cores_moves():
    nodes = (NodeInfo("n0", 8, cpus=2), NodeInfo("n1", 8, cpus=64))  # n0 shrank to 2 cores
    snap = make_snapshot(nodes, [make_job("j", gpus=2, cpus_per_rank=2)], current={"j": [("n0", (0, 1))]})
    assert node_of(place(snap, {"j": 2}).placements["j"]) == {"n1"}


def test_jobs_without_requests_place_exactly_as_before():
    plain = (NodeInfo("n0", 4), NodeInfo("n1", 8), NodeInfo("n2", 8))
    reported_none = tuple(NodeInfo(n.name, n.gpus, cpus=0.0, memory_bytes=0.0) for n in plain)  # older agents
    jobs = [make_job("a", gpus=3), make_job("b", gpus=6, submit=1), make_job("c", gpus=8, submit=2)]
    current = {"a": [("n1", (0, 1, 2))]}
    expected = place(make_snapshot(plain, jobs, current=current), {"a": 3, "b": 6, "c": 8}).placements
    got = place(make_snapshot(reported_none, jobs, current=current), {"a": 3, "b": 6, "c": 8}).placements
    assert got == expected and len(got) == 3


def test_a_node_that_reports_no_cores_takes_no_rank_that_requests_them():
    nodes = (NodeInfo("n0-old-agent", 8, cpus=0.0, memory_bytes=0.0), NodeInfo("n1-new-agent", 8, cpus=32, memory_bytes=64 * GiB))
    jobs = [make_job("cores", gpus=2, cpus_per_rank=1), make_job("memory", gpus=2, memory_bytes_per_rank=GiB, submit=1),
            make_job("none", gpus=8, submit=2)]
    result = place(make_snapshot(nodes, jobs), {"none": 8, "cores": 2, "memory": 2}, order=["none", "cores", "memory"])
    assert node_of(result.placements["none"]) == {"n0-old-agent"}
    assert node_of(result.placements["cores"]) == node_of(result.placements["memory"]) == {"n1-new-agent"}


def test_node_room_counts_ranks_and_gives_back():
    room = NodeRoom((NodeInfo("n0", 8, cpus=10, memory_bytes=8 * GiB),))
    job = make_job("j", gpus=4, cpus_per_rank=3, memory_bytes_per_rank=GiB)
    assert room.ranks_fit("n0", job) == 3  # cores bind before memory (8)
    room.take(job, (("n0", (0, 1)),))
    assert room.ranks_fit("n0", job) == 1 and not room.fits(job, (("n0", (2, 3)),))
    room.give_back(job, (("n0", (0,)),))
    assert room.ranks_fit("n0", job) == 2
    assert room.ranks_fit("n0", make_job("free", gpus=1)) == math.inf
    assert room.ranks_fit("elsewhere", job) == 0  # a node the room does not know offers nothing


# -- the invariant ---------------------------------------------------------------------------


def cluster():
    nodes = (NodeInfo("n0", 8, cpus=8, memory_bytes=32 * GiB), NodeInfo("n1", 8))
    jobs = [make_job("a", gpus=2, cpus_per_rank=3, memory_bytes_per_rank=8 * GiB),
            make_job("b", gpus=2, cpus_per_rank=2, memory_bytes_per_rank=10 * GiB), make_job("c", gpus=4)]
    return make_snapshot(nodes, jobs)


def test_a_plan_within_every_nodes_cores_and_memory_passes():
    plan = Plan({"a": allocation(("n0", (0, 1))), "b": allocation(("n1", (0, 1))), "c": allocation(("n0", (2, 3, 4, 5)))})
    assert plan_problems(cluster(), plan) == []


def test_requested_cores_beyond_a_node_name_node_jobs_and_resource():
    plan = Plan({"a": allocation(("n0", (0, 1))), "b": allocation(("n0", (2, 3)))})  # 10 cores of 8, 36 GiB of 32
    problems = plan_problems(cluster(), plan)
    assert "node n0: cores requested by the ranks of a, b (10) exceed its 8" in problems
    assert f"node n0: memory requested by the ranks of a, b ({36 * GiB} B) exceed its {32 * GiB} B" in problems
    with pytest.raises(AssertionError, match="cores requested"):
        check_plan(cluster(), plan)


def test_memory_alone_beyond_a_node_is_reported():
    plan = Plan({"b": allocation(("n0", (0, 1, 2, 3)), batch_size=0)})
    snap = make_snapshot(cluster().nodes, [make_job("b", gpus=4, memory_bytes_per_rank=9 * GiB)])
    assert plan_problems(snap, plan) == [f"node n0: memory requested by the ranks of b ({36 * GiB} B) exceed its {32 * GiB} B"]


# -- every policy ------------------------------------------------------------------------------


def scarce_cores():
    """GPUs to spare, cores not: the 4-GPU nodes (the tightest fit, and the cached ones) offer
    2 cores; only the 8-GPU nodes can hold ranks that request 4 cores. Two jobs run already."""
    nodes = (NodeInfo("small-0", 4, cpus=2, memory_bytes=8 * GiB, cache_capacity_bytes=1e9),
             NodeInfo("small-1", 4, cpus=2, memory_bytes=8 * GiB, cache_capacity_bytes=1e9),
             NodeInfo("big-0", 8, cpus=40, memory_bytes=256 * GiB), NodeInfo("big-1", 8, cpus=40, memory_bytes=256 * GiB),
             NodeInfo("infer-0", 4, pool="inference", cpus=1, memory_bytes=8 * GiB))
    jobs = [make_job("heavy-a", gpus=4, cpus_per_rank=4, dataset="d0"),
            make_job("heavy-b", gpus=4, min_gpus=2, max_gpus=8, cpus_per_rank=4, memory_bytes_per_rank=16 * GiB, submit=1),
            make_job("light", gpus=4, cpus_per_rank=0.5, submit=2),
            make_job("plain", gpus=4, submit=3),
            make_job("running", gpus=2, cpus_per_rank=8, submit=4)]
    cached = {("small-0", "d0"): 5e8, ("small-1", "d0"): 5e8}
    return make_snapshot(nodes, jobs, time=100.0, current={"running": [("big-0", (0, 1))]}, cached_bytes=cached)


@pytest.mark.parametrize("name", policy_names())
def test_no_policy_places_a_rank_where_its_cores_or_memory_do_not_fit(name):
    snap = scarce_cores()
    plan = get_policy(name).schedule(snap)
    assert plan_problems(snap, plan) == []
    room = {node.name: node for node in snap.nodes}
    jobs = {job.job_id: job for job in snap.jobs}
    for job_id, alloc in plan.allocations.items():
        for node, indices in alloc.placement:
            assert len(indices) * jobs[job_id].cpus_per_rank <= room[node].cpus, (job_id, node)
            assert len(indices) * jobs[job_id].memory_bytes_per_rank <= room[node].memory_bytes, (job_id, node)
    assert plan.gpus_of("heavy-a") in (0, 4) and not node_of(plan.get("heavy-a").placement if plan.get("heavy-a") else ()) & {"small-0", "small-1"}


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot=snapshots(max_nodes=5, max_jobs=10, requests=True))
def test_policy_plans_keep_every_node_within_its_cores_and_memory(name, snapshot):
    check_plan(snapshot, get_policy(name).schedule(snapshot))
    check_plan(snapshot, quota_schedule(get_policy(name), snapshot))


# -- DeepBoot's lending, tenant quotas, co-design, the elastic bound ----------------------------------


def test_lending_takes_a_ranks_cores_once_whichever_pool_places_it():
    nodes = (NodeInfo("n0", 2, cpus=4), NodeInfo("i0", 4, pool="inference", cpus=4))
    jobs = [make_job("a", gpus=2, cpus_per_rank=2), make_job("b", gpus=2, cpus_per_rank=2, submit=1)]
    result = place_lending(make_snapshot(nodes, jobs), {"a": 2, "b": 2}, order=["a", "b"])
    assert result.placements["a"] == (("n0", (0, 1)),)
    assert result.placements["b"] == (("i0", (0, 1)),)


def test_a_growing_job_grows_only_as_far_as_its_nodes_cores():
    nodes = (NodeInfo("n0", 8, cpus=6), NodeInfo("i0", 4, pool="inference", cpus=2))
    job = make_job("j", gpus=2, min_gpus=1, max_gpus=8, cpus_per_rank=2)
    snap = make_snapshot(nodes, [job], current={"j": [("n0", (0, 1))]})
    # n0's 6 cores hold one more rank; the rest (5) fits nowhere at once: the job grows to 3.
    assert place_lending(snap, {"j": 8}).placements["j"] == (("n0", (0, 1, 2)),)
    # Growing by 2: one more on n0, one lent GPU of i0 (whose 2 cores hold one rank).
    placement = place_lending(snap, {"j": 4}).placements["j"]
    assert {node: len(ix) for node, ix in placement} == {"n0": 3, "i0": 1}
    assert plan_problems(snap, plan_from_placements({"j": placement})) == []


def test_tenant_runs_share_a_nodes_cores():
    # Each tenant's slice is 4 GPUs of the one node; its 16 cores hold one tenant's job, not both.
    nodes = (NodeInfo("n0", 8, cpus=16),)
    jobs = [make_job("a", gpus=4, cpus_per_rank=4, tenant="t1"), make_job("b", gpus=4, cpus_per_rank=4, tenant="t2", submit=1)]
    quotas = {"t1": TenantQuota(gpus={"": 4}), "t2": TenantQuota(gpus={"": 4})}
    snap = make_snapshot(nodes, jobs, quotas=quotas)
    plan = quota_schedule(get_policy("fifo"), snap)
    assert plan_problems(snap, plan) == [] and sum(1 for a in plan.allocations.values() if a.gpus) == 1


def test_less_requested_takes_off_what_placed_ranks_request():
    nodes = (NodeInfo("n0", 8, cpus=16, memory_bytes=64 * GiB), NodeInfo("n1", 8))
    job = make_job("a", gpus=3, cpus_per_rank=2, memory_bytes_per_rank=GiB)
    shown = less_requested(nodes, {"a": allocation(("n0", (0, 1, 2))), "gone": allocation(("n0", (3,)))}, [job])
    assert (shown[0].cpus, shown[0].memory_bytes) == (10, 61 * GiB) and shown[1] is nodes[1]
    assert less_requested(nodes, {}, [job]) is nodes


def test_spreading_for_cache_stays_where_the_ranks_cores_are():
    nodes = tuple(NodeInfo(f"n{k}", 4, cache_capacity_bytes=1e6, cpus=16 if k == 0 else 1) for k in range(4))
    jobs = [make_job("j", gpus=4, cpus_per_rank=2, dataset="d"), make_job("plain", gpus=4, dataset="d", submit=1)]
    snap = make_snapshot(nodes + (NodeInfo("n9", 4, cache_capacity_bytes=1e6),), jobs, storage_bandwidth_bytes_per_s=1e6)
    spread = spread_for_cache(snap, {"j": (("n0", (0, 1, 2, 3)),), "plain": (("n9", (0, 1, 2, 3)),)}, ["j", "plain"])
    assert spread["j"] == (("n0", (0, 1, 2, 3)),)  # the other nodes offer a rank 1 core, not 2
    assert len(spread["plain"]) > 1  # a job without requests still spreads


def test_an_elastic_job_is_held_to_the_ranks_the_cluster_can_hold():
    nodes = (NodeInfo("n0", 8, memory_bytes=16 * GiB), NodeInfo("n1", 8, memory_bytes=64 * GiB))
    job = make_job("j", gpus=4, min_gpus=1, max_gpus=16, memory_bytes_per_rank=8 * GiB)
    rigid = make_job("r", gpus=16, memory_bytes_per_rank=8 * GiB)  # can never run: its bounds stay
    snap = within_reach(make_snapshot(nodes, [job, rigid, make_job("p", gpus=2)]))
    assert {j.job_id: j.max_gpus for j in snap.jobs} == {"j": 2 + 8, "r": 16, "p": 2}
    plan = quota_schedule(get_policy("pollux"), make_snapshot(nodes, [job]))
    assert 1 <= plan.gpus_of("j") <= 10


def test_within_reach_leaves_a_snapshot_without_requests_alone():
    snap = make_snapshot((NodeInfo("n0", 8, cpus=0.0),), [make_job("p", gpus=2, min_gpus=1, max_gpus=8)])
    assert within_reach(snap) is snap


def test_within_reach_follows_the_snapshots_hint_to_the_jobs_that_request():
    """Whether any job requests cores or memory is followed from snapshot to snapshot by the
    hint (ClusterSnapshot.jobs_changed), and comes out as a look at every job does."""
    import random

    from scheduler import rank_requests
    from scheduler.policy import ChangedSince

    rng = random.Random(3)
    nodes = (NodeInfo("n0", 8, cpus=64.0, memory_bytes=64 * GiB),)
    jobs = {f"j{i}": make_job(f"j{i}", gpus=1, min_gpus=1, max_gpus=8) for i in range(30)}
    last = None
    without = 0
    for step in range(200):
        job_id = f"j{rng.randrange(40)}"
        roll = rng.random()
        if roll < 0.3:
            jobs.pop(job_id, None)
        elif roll < 0.6:
            jobs[job_id] = make_job(job_id, gpus=1, min_gpus=1, max_gpus=8,
                                    cpus_per_rank=rng.choice((0.0, 0.0, 2.0)))
        if step % 10 == 9:  # the jobs that request drop their requests, or end
            for job in [j for j in jobs.values() if j.has_requests]:
                if rng.random() < 0.5:
                    del jobs[job.job_id]
                else:
                    jobs[job.job_id] = make_job(job.job_id, gpus=1, min_gpus=1, max_gpus=8)
        snap = make_snapshot(nodes, list(jobs.values()))
        if last is not None and rng.random() < 0.9:
            before = {j.job_id: j for j in last.jobs}
            snap = dataclasses.replace(snap, jobs_changed=ChangedSince(last.jobs, snap.jobs, {
                j: jobs.get(j) for j in before.keys() | jobs.keys() if before.get(j) is not jobs.get(j)}))
        assert rank_requests._any_requests(snap) == any(j.has_requests for j in jobs.values()), step
        if not any(j.has_requests for j in jobs.values()):
            assert within_reach(snap) is snap
            without += 1
        last = snap
    assert without > 20, without
