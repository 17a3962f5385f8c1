"""The plan invariants checked by what changed (scheduler.plan_check) find what the whole check
finds, plan after plan: every problem the whole check lists (with its message), and none else."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from estimator.job_model import JobModel
from scheduler.invariants import PlanViolation, plan_problems
from scheduler.plan_check import PlanCheck
from scheduler.policy import Allocation, ChangedSince, ClusterSnapshot, JobInfo, NodeInfo, Plan

MODEL = JobModel.from_profile("cifar10")


def _cluster(rng: random.Random) -> tuple[tuple[NodeInfo, ...], dict[str, JobInfo]]:
    nodes = tuple(NodeInfo(name=f"n{k}", gpus=4, cache_capacity_bytes=1000.0, nic_bytes_per_s=500.0, cpus=16.0,
                           memory_bytes=64e9) for k in range(8))
    jobs = {}
    for k in range(40):
        low = rng.choice([1, 1, 2])
        jobs[f"j{k}"] = JobInfo(job_id=f"j{k}", model=MODEL, submit_time_s=float(k), min_gpus=low, max_gpus=low + 2,
                                target_samples=1e6, cpus_per_rank=rng.choice([0.0, 0.0, 2.0]))
    return nodes, jobs


def _fresh(rng: random.Random, job: JobInfo, free: list[tuple[str, int]]) -> Allocation | None:
    if len(free) < job.min_gpus:
        return None
    taken = [free.pop(rng.randrange(len(free))) for _ in range(job.min_gpus)]
    placement: dict[str, list[int]] = {}
    for node, index in taken:
        placement.setdefault(node, []).append(index)
    nodes = sorted(placement)
    return Allocation(placement=tuple((n, tuple(sorted(placement[n]))) for n in nodes),
                      cache_bytes={nodes[0]: float(rng.choice([0, 100, 250]))},
                      remote_io_bytes_per_s=rng.choice([math.inf, 50.0, 120.0]))


def _broken(rng: random.Random, allocations: dict[str, Allocation], jobs: dict[str, JobInfo]) -> tuple[str, dict]:
    """One rule broken in a copy of ``allocations``."""
    broken = dict(allocations)
    victim, other = rng.sample(sorted(allocations), 2)
    kind = rng.choice(["double", "index", "bounds", "cache", "batch", "nic", "budget", "cores", "unknown node", "gone"])
    a = broken[victim]
    if kind == "double":
        broken[victim] = dataclasses.replace(a, placement=broken[other].placement)
    elif kind == "index":
        broken[victim] = dataclasses.replace(a, placement=(("n0", (7,)),))
    elif kind == "bounds":
        broken[victim] = dataclasses.replace(a, placement=a.placement + (("n7", (0, 1, 2, 3)),))
    elif kind == "cache":
        broken[victim] = dataclasses.replace(a, cache_bytes={a.placement[0][0]: 5000.0})
    elif kind == "batch":
        broken[victim] = dataclasses.replace(a, batch_size=-1)
    elif kind == "nic":
        broken[victim] = dataclasses.replace(a, remote_io_bytes_per_s=10_000.0)
    elif kind == "budget":
        broken[victim] = dataclasses.replace(a, remote_io_bytes_per_s=900.0)
    elif kind == "cores":
        jobs[victim] = dataclasses.replace(jobs[victim], cpus_per_rank=64.0)
    elif kind == "unknown node":
        broken[victim] = dataclasses.replace(a, placement=(("n99", (0,)),))
    else:
        broken["not-a-job"] = a
    return kind, broken


def _diff(before: dict, after: dict) -> dict:
    return {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) is not after.get(k)}


@pytest.mark.parametrize("hints", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_checked_by_changes_finds_what_the_whole_check_finds(seed: int, hints: bool) -> None:
    """With ``hints``, each snapshot and plan says which jobs and allocations changed since the
    last (ClusterSnapshot.jobs_changed, Plan.changed), as the live scheduler's and fifo's do."""
    rng = random.Random(seed)
    nodes, jobs = _cluster(rng)
    check = PlanCheck()
    allocations: dict[str, Allocation] = {}
    how = []
    last: tuple[ClusterSnapshot, Plan] | None = None
    followed = 0
    for step in range(120):
        # Jobs stop and start (each start on free GPUs): a valid plan, changed a little.
        for job_id in rng.sample(sorted(allocations), min(2, len(allocations))):
            del allocations[job_id]
        free = [(n.name, i) for n in nodes for i in range(n.gpus)]
        held = {(node, i) for a in allocations.values() for node, idx in a.placement for i in idx}
        free = [g for g in free if g not in held]
        for job_id in rng.sample([j for j in jobs if j not in allocations], 3):
            fresh = _fresh(rng, jobs[job_id], free)
            if fresh is not None:
                allocations[job_id] = fresh
        if step % 7 == 3:  # the same allocations made again (a whole pass after a kept queue): equal, not identical
            allocations = {job_id: dataclasses.replace(a) for job_id, a in allocations.items()}
        if step % 6 == 5:  # a job's info made again: equal, or with other bounds
            job = jobs[rng.choice(sorted(jobs))]
            jobs[job.job_id] = dataclasses.replace(job, max_gpus=max(job.min_gpus, job.max_gpus + rng.choice([-1, 0, 1])))
        plan_jobs = dict(jobs)
        if step % 9 == 8:  # a job gone from the snapshot (a problem where the plan keeps it)
            del plan_jobs[rng.choice(sorted(plan_jobs))]
        plan = Plan(dict(allocations))
        kind = "valid"
        if step % 5 == 4:
            kind, broken = _broken(rng, allocations, plan_jobs)
            plan = Plan(broken)
        snapshot = ClusterSnapshot(time_s=float(step), nodes=nodes, jobs=tuple(plan_jobs.values()),
                                   storage_bandwidth_bytes_per_s=1500.0)
        if hints and last is not None:
            snapshot = dataclasses.replace(snapshot, jobs_changed=ChangedSince(
                last[0].jobs, snapshot.jobs, _diff({j.job_id: j for j in last[0].jobs}, plan_jobs)))
            plan = Plan(plan.allocations, changed=ChangedSince(
                last[1].allocations, plan.allocations, _diff(dict(last[1].allocations), dict(plan.allocations))))
        last = snapshot, plan
        expected = plan_problems(snapshot, plan)
        assert check.problems(snapshot, plan) == expected, (step, kind)
        followed += check.last_check == "changes" and check._sums is not None and check._sums.hints_followed == (True, True)
        if kind != "valid":
            assert expected, kind  # every injected break is a real problem
        how.append((bool(expected), check.last_check))
    # A plan is checked by its changes unless it is the first or follows a refused one (and the
    # random plans, not only the broken ones, sometimes exceed the storage budget).
    for step, ((refused, way), (refused_before, _)) in enumerate(zip(how[1:], how), start=1):
        if not refused:
            assert way == ("whole" if refused_before else "changes"), step
    assert sum(way == "changes" for _, way in how) > 30
    assert (followed > 20) if hints else (followed == 0), followed


def test_check_raises_the_whole_checks_message_and_a_new_node_tuple_checks_whole() -> None:
    rng = random.Random(5)
    nodes, jobs = _cluster(rng)
    free = [(n.name, i) for n in nodes for i in range(n.gpus)]
    allocations = {j: a for j in list(jobs)[:6] if (a := _fresh(rng, jobs[j], free)) is not None}
    snapshot = ClusterSnapshot(time_s=0.0, nodes=nodes, jobs=tuple(jobs.values()))
    check = PlanCheck()
    check.check(snapshot, Plan(allocations))
    check.check(snapshot, Plan(allocations))
    assert check.last_check == "changes"
    first, second = list(allocations)[:2]
    doubled = dict(allocations, **{second: dataclasses.replace(allocations[second], placement=allocations[first].placement)})
    with pytest.raises(PlanViolation, match="already held by"):
        check.check(snapshot, Plan(doubled))
    check.check(snapshot, Plan(allocations))  # after a refusal: whole again
    assert check.last_check == "whole"
    check.check(dataclasses.replace(snapshot, nodes=tuple(nodes)), Plan(allocations))
    assert check.last_check == "changes"  # an equal tuple that is the same object
    check.check(dataclasses.replace(snapshot, nodes=nodes[:-1] + (nodes[-1],)), Plan(allocations))
    assert check.last_check == "whole"
