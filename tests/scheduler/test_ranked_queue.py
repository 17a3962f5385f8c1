"""A ranked policy's kept jobs (scheduler.policies.ranked_queue) give the plan a whole pass gives,
call after call, while jobs arrive, end, progress, start, stop and are preempted; and the memo is
actually used, not silently bypassed."""

from __future__ import annotations

import dataclasses
import random

import pytest

from estimator.job_model import JobModel
from scheduler.policies.sjf import SjfPolicy
from scheduler.policies.tiresias import TiresiasPolicy
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan
from tests.support.policy_hints import check_plan_hint, hinted, settled

MODELS = (JobModel.from_profile("cifar10"), JobModel.from_profile("ncf"))


# Tiresias with a low threshold, so running jobs are demoted (and preempted) within the runs.
POLICIES = {"sjf": SjfPolicy, "tiresias": lambda: TiresiasPolicy(thresholds_gpu_s=(2000.0, 6000.0))}


def _whole(snapshot: ClusterSnapshot, policy: str = "sjf") -> Plan:
    return POLICIES[policy]()._whole_pass(snapshot)


def _job(rng: random.Random, number: int, time_s: float) -> JobInfo:
    count = rng.choice([1, 1, 2, 3, 4, 8])
    # Jobs alike in model and length (and a few in arrival) tie on their key: the order falls to
    # priority, arrival and id, as the whole pass's tuples compare.
    return JobInfo(job_id=f"job-{number:04d}", model=rng.choice(MODELS),
                   submit_time_s=time_s + rng.choice([0.0, 0.0, rng.random()]),
                   min_gpus=1, max_gpus=8, requested_gpus=count, priority=rng.choice([0, 0, 0, 1]),
                   target_samples=rng.choice([2e5, 1e6, 1e6, 5e6]), samples_done=0.0)


@pytest.mark.parametrize("hints", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_kept_jobs_give_the_whole_pass_plan_call_after_call(name: str, seed: int, hints: bool) -> None:
    rng = random.Random(seed)
    nodes = tuple(NodeInfo(name=f"n{k:02d}", gpus=rng.choice([4, 8])) for k in range(10))
    jobs = {j.job_id: j for j in (_job(rng, k, float(k)) for k in range(50))}
    policy = POLICIES[name]()
    current = Plan()
    used, preempted, started = [], 0, 0
    arrived = len(jobs)
    last_snapshot, last_plan, fewer = None, None, 0
    for step in range(50):
        snapshot = ClusterSnapshot(time_s=100.0 + step, nodes=nodes, jobs=tuple(jobs.values()), current=current,
                                   restart_cost_s=rng.choice([30.0, 30.0, 0.0]))
        if hints:
            snapshot = hinted(last_snapshot, snapshot, rng)
        plan = policy.schedule(snapshot)
        assert plan.allocations == _whole(snapshot, name).allocations, f"step {step}"
        used.append(policy.ranked.last_call)
        check_plan_hint(last_plan, plan)
        if hints and step >= 2:  # the hints followed: only the jobs they name looked at
            named = len(snapshot.jobs_changed.entries) + len(snapshot.current.changed.entries)
            assert policy.ranked.last_looked <= min(named, len(snapshot.jobs)), f"step {step}"
            fewer += named < len(snapshot.jobs)
        preempted += sum(1 for j in current.allocations if j not in plan.allocations)
        started += sum(1 for j in plan.allocations if j not in current.allocations)
        last_snapshot, last_plan = snapshot, plan
        # Carried out, mostly as planned: a job the plan starts may be held back a round, running
        # jobs end, the others progress (their rank moves), jobs arrive.
        held_back = set(rng.sample(sorted(plan.allocations), min(2, len(plan.allocations)))) if step % 4 == 1 else set()
        current = Plan({j: a for j, a in plan.allocations.items() if j not in held_back or j in current.allocations})
        for job_id in rng.sample(sorted(current.allocations), min(2, len(current.allocations))):
            del jobs[job_id]
        current = Plan({j: a for j, a in current.allocations.items() if j in jobs})
        for job_id in current.allocations:
            if rng.random() < 0.7:
                job = jobs[job_id]
                jobs[job_id] = dataclasses.replace(job, samples_done=min(job.target_samples, job.samples_done + 3e4),
                                                   attained_gpu_s=job.attained_gpu_s + 60.0 * job.requested)
        for _ in range(rng.randint(0, 3)):
            arrived += 1
            job = _job(rng, arrived, 100.0 + step)
            jobs[job.job_id] = job
        if step % 7 == 3 and current.allocations:  # a running job's allocation comes back as an equal, new object
            job_id = rng.choice(sorted(current.allocations))
            allocations = dict(current.allocations)
            allocations[job_id] = dataclasses.replace(allocations[job_id])
            current = Plan(allocations)
    # The first call and the second (a cluster is kept once seen twice) are whole passes; the rest by the memo.
    assert used[:2] == ["whole", "whole"] and used[2:] == ["queue"] * 48, policy.ranked.why_whole
    assert preempted > 0 and started > 0, "the runs exercised preemption and starts"
    assert not hints or fewer >= 20, "the hints named fewer jobs than the snapshot had"


def test_a_short_job_preempting_many_is_walked_past_the_vectorized_searches() -> None:
    """72 running one-GPU jobs left out by one short 72-GPU job: more events than the walk searches
    for one by one, so the rest of the order is walked job by job, to the same plan."""
    nodes = tuple(NodeInfo(name=f"n{k}", gpus=8) for k in range(10))
    model = MODELS[0]
    long_jobs = [JobInfo(job_id=f"long-{k:02d}", model=model, submit_time_s=float(k), min_gpus=1, max_gpus=1,
                         target_samples=1e9) for k in range(80)]
    policy = SjfPolicy()
    snapshot = ClusterSnapshot(time_s=100.0, nodes=nodes, jobs=tuple(long_jobs))
    for _ in range(3):
        plan = policy.schedule(snapshot)
        snapshot = dataclasses.replace(snapshot, current=plan)
    assert policy.ranked.last_call == "queue" and len(plan.allocations) == 80
    short = JobInfo(job_id="short", model=model, submit_time_s=200.0, min_gpus=1, max_gpus=72, requested_gpus=72,
                    target_samples=1e3)
    arrival = dataclasses.replace(snapshot, jobs=(*snapshot.jobs, short))
    plan = policy.schedule(arrival)
    assert policy.ranked.last_call == "queue" and policy.ranked.last_events == 64
    assert plan.allocations == _whole(arrival).allocations
    assert plan.get("short").gpus == 72 and len(plan.allocations) == 9


def test_what_the_memo_does_not_follow_makes_a_whole_pass() -> None:
    """A job asking for cores per rank, a node change, a running job whose request changes, a job
    on a GPU another holds, cached datasets, GPU types: each makes the call a whole pass (and the
    plan is still right)."""
    rng = random.Random(9)
    nodes = tuple(NodeInfo(name=f"n{k}", gpus=8) for k in range(4))
    jobs = {j.job_id: j for j in (_job(rng, k, float(k)) for k in range(14))}
    policy = SjfPolicy()
    snapshot = settled(policy, ClusterSnapshot(time_s=1.0, nodes=nodes, jobs=tuple(jobs.values())))
    assert policy.ranked.last_call == "queue"

    def call(changed: ClusterSnapshot) -> str:
        assert policy.schedule(changed).allocations == _whole(changed).allocations
        return policy.ranked.last_call

    def again() -> None:  # the memo is built again from the second call on the same nodes
        call(snapshot)
        call(snapshot)
        assert call(snapshot) == "queue"

    first = next(iter(jobs))
    assert call(dataclasses.replace(snapshot, jobs=(*snapshot.jobs, dataclasses.replace(
        jobs[first], job_id="job-cores", cpus_per_rank=2.0)))) == "whole"
    again()
    assert call(dataclasses.replace(snapshot, nodes=nodes + (NodeInfo(name="n9", gpus=8),))) == "whole"
    again()
    running = next(iter(snapshot.current.allocations))
    resized = tuple(dataclasses.replace(j, requested_gpus=j.requested + 1, max_gpus=8) if j.job_id == running else j
                    for j in snapshot.jobs)
    assert call(dataclasses.replace(snapshot, jobs=resized)) == "whole"
    again()
    a, b = list(snapshot.current.allocations)[:2]
    doubled = dict(snapshot.current.allocations)
    doubled[b] = Allocation(placement=snapshot.current.allocations[a].placement)
    assert call(dataclasses.replace(snapshot, current=Plan(doubled))) == "whole"
    again()
    assert call(dataclasses.replace(snapshot, cached_bytes={("n0", "imagenet"): 1e9})) == "whole"
    again()
    typed = tuple(dataclasses.replace(n, gpu_type="v100" if k % 2 else "k80") for k, n in enumerate(nodes))
    assert call(dataclasses.replace(snapshot, nodes=typed, current=Plan())) == "whole"
    assert call(dataclasses.replace(snapshot, nodes=typed, current=Plan())) == "whole"  # not kept: two types


def test_a_policy_with_kept_jobs_pickles_and_its_copy_starts_afresh() -> None:
    """Simulation runs send their policy to worker processes: the memo is not state."""
    import copy
    import pickle

    policy = SjfPolicy()
    snapshot = ClusterSnapshot(time_s=1.0, nodes=(NodeInfo(name="n0", gpus=8),), jobs=(_job(random.Random(1), 1, 0.0),))
    policy.schedule(snapshot)
    policy.schedule(snapshot)
    assert policy.ranked._state is not None
    for clone in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy)):
        assert clone == policy and clone.ranked._state is None
        assert clone.schedule(snapshot).allocations == policy.schedule(snapshot).allocations
