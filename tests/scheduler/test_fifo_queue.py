"""FIFO's kept queue (scheduler.policies.fifo_queue) gives the plan a whole pass gives, call after
call, while jobs arrive, end, start and stop; and it is actually used, not silently bypassed."""

from __future__ import annotations

import dataclasses
import random

import pytest

from estimator.job_model import JobModel
from scheduler.policies.fifo import FifoPolicy
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan
from tests.support.policy_hints import check_plan_hint, hinted, settled

MODEL = JobModel.from_profile("cifar10")


def _whole(snapshot: ClusterSnapshot, backfill: bool) -> Plan:
    return FifoPolicy(backfill=backfill).schedule(snapshot)  # a fresh policy: no queue


def _job(rng: random.Random, number: int, time_s: float) -> JobInfo:
    low = rng.choice([1, 1, 2, 3, 4, 8])
    return JobInfo(job_id=f"job-{number:04d}", model=MODEL, submit_time_s=time_s + rng.random(),
                   min_gpus=low, max_gpus=low + rng.choice([0, 0, 4]), target_samples=1e6,
                   requested_gpus=rng.choice([0, low]))


@pytest.mark.parametrize("hints", [False, True])
@pytest.mark.parametrize("backfill", [True, False])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_queue_gives_the_whole_pass_plan_call_after_call(backfill: bool, seed: int, hints: bool) -> None:
    """With ``hints``, each snapshot says which jobs and current allocations changed (as the live
    scheduler's do), and the queue follows those alone."""
    rng = random.Random(seed)
    nodes = tuple(NodeInfo(name=f"n{k:02d}", gpus=rng.choice([4, 8])) for k in range(12))
    jobs = {j.job_id: j for j in (_job(rng, k, float(k)) for k in range(60))}
    policy = FifoPolicy(backfill=backfill)
    current = Plan()
    used = []
    arrived = len(jobs)
    last_snapshot, last_plan, hinted_plans, fewer = None, None, 0, 0
    for step in range(40):
        snapshot = ClusterSnapshot(time_s=100.0 + step, nodes=nodes, jobs=tuple(jobs.values()), current=current)
        if hints:
            snapshot = hinted(last_snapshot, snapshot, rng)
        plan = policy.schedule(snapshot)
        assert plan.allocations == _whole(snapshot, backfill).allocations, f"step {step}"
        used.append(policy.queue.last_call)
        check_plan_hint(last_plan, plan)
        hinted_plans += plan.changed is not None
        if hints and step >= 2:  # the hints followed: only the jobs they name compared, not every job
            named = len(snapshot.jobs_changed.entries) + len(snapshot.current.changed.entries)
            assert policy.queue.last_looked <= min(named, len(snapshot.jobs)), f"step {step}"
            fewer += named < len(snapshot.jobs)
        last_snapshot, last_plan = snapshot, plan
        # Carried out, mostly as planned: a job the plan starts may be held back a round (GPUs
        # not yet released), running jobs end, progress changes a running job's JobInfo.
        held_back = set(rng.sample(sorted(plan.allocations), min(2, len(plan.allocations)))) if step % 4 == 1 else set()
        current = Plan({j: a for j, a in plan.allocations.items()
                        if j not in held_back or j in current.allocations})
        for job_id in rng.sample(sorted(current.allocations), min(3, len(current.allocations))):
            del jobs[job_id]
        current = Plan({j: a for j, a in current.allocations.items() if j in jobs})
        for _ in range(rng.randint(0, 4)):
            arrived += 1
            job = _job(rng, arrived, 100.0 + step)
            jobs[job.job_id] = job
        for job_id in rng.sample(sorted(current.allocations), min(2, len(current.allocations))):
            jobs[job_id] = dataclasses.replace(jobs[job_id], samples_done=jobs[job_id].samples_done + 10.0)
        if step % 5 == 2:  # a running job stops (still active) and a waiting one starts on its GPUs
            order = list(jobs)  # the taker comes first in the snapshot: its GPUs are given back after it asks
            waiting = [j for j in jobs.values() if j.job_id not in current.allocations]
            for running_id, allocation in sorted(current.allocations.items(), key=lambda item: -order.index(item[0])):
                taker = next((j for j in waiting if j.min_gpus <= allocation.gpus <= j.max_gpus
                              and order.index(j.job_id) < order.index(running_id)), None)
                if taker is not None:
                    allocations = dict(current.allocations)
                    allocations[taker.job_id] = allocations.pop(running_id)
                    current = Plan(allocations)
                    break
        if step % 7 == 3 and current.allocations:  # a running job's allocation comes back as an equal, new object
            job_id = rng.choice(sorted(current.allocations))
            allocations = dict(current.allocations)
            allocations[job_id] = dataclasses.replace(allocations[job_id])
            current = Plan(allocations)
    # The first call and the second (a cluster is kept once seen twice) are whole passes; the rest by the queue.
    assert used[:2] == ["whole", "whole"] and used[2:] == ["queue"] * 38
    assert hinted_plans == 37, "each plan of the queue but its first says what changed"
    assert not hints or fewer >= 20, "the hints named fewer jobs than the snapshot had"


def test_what_the_queue_does_not_follow_makes_a_whole_pass() -> None:
    """A job that asks for cores per rank, a node change, a job whose bounds change, a running
    job on a GPU another holds: each makes the call a whole pass (and the plan is still right)."""
    rng = random.Random(9)
    nodes = tuple(NodeInfo(name=f"n{k}", gpus=8) for k in range(4))
    jobs = {j.job_id: j for j in (_job(rng, k, float(k)) for k in range(10))}
    policy = FifoPolicy()
    snapshot = settled(policy, ClusterSnapshot(time_s=1.0, nodes=nodes, jobs=tuple(jobs.values())))
    assert policy.queue.last_call == "queue"

    def call(changed: ClusterSnapshot) -> str:
        assert policy.schedule(changed).allocations == _whole(changed, True).allocations
        return policy.queue.last_call

    first = next(iter(jobs))
    with_cores = dataclasses.replace(snapshot, jobs=(*snapshot.jobs, dataclasses.replace(
        jobs[first], job_id="job-cores", cpus_per_rank=2.0)))
    assert call(with_cores) == "whole"
    assert call(snapshot) == "whole"  # the queue was dropped: built again
    assert call(snapshot) == "queue"
    assert call(dataclasses.replace(snapshot, nodes=nodes + (NodeInfo(name="n9", gpus=8),))) == "whole"
    call(snapshot)
    call(snapshot)
    running = next(iter(snapshot.current.allocations))
    rebound = tuple(dataclasses.replace(j, max_gpus=j.max_gpus + 1) if j.job_id == running else j for j in snapshot.jobs)
    assert call(dataclasses.replace(snapshot, jobs=rebound)) == "whole"
    call(snapshot)
    call(snapshot)
    a, b = list(snapshot.current.allocations)[:2]
    doubled = dict(snapshot.current.allocations)
    doubled[b] = Allocation(placement=snapshot.current.allocations[a].placement)
    assert call(dataclasses.replace(snapshot, current=Plan(doubled))) == "whole"


def test_a_policy_with_a_queue_pickles_and_its_copy_starts_afresh() -> None:
    """Simulation runs send their policy to worker processes: the queue is a memo, not state."""
    import copy
    import pickle

    policy = FifoPolicy()
    nodes = (NodeInfo(name="n0", gpus=8),)
    snapshot = ClusterSnapshot(time_s=1.0, nodes=nodes, jobs=(_job(random.Random(1), 1, 0.0),))
    policy.schedule(snapshot)
    policy.schedule(snapshot)
    assert policy.queue._state is not None
    for clone in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy)):
        assert clone == policy and clone.queue._state is None
        assert clone.schedule(snapshot).allocations == policy.schedule(snapshot).allocations


def test_a_carried_view_of_free_gpus_stays_compact_over_many_rounds() -> None:
    """The queue's FreeGpus lives across calls: GPUs taken and given back round after round must
    not pile up stale names that each copy (one per call that places a job) walks again."""
    from scheduler.placement import FreeGpus

    snapshot = ClusterSnapshot(time_s=0.0, nodes=tuple(NodeInfo(name=f"n{k}", gpus=8) for k in range(4)), jobs=())
    free = FreeGpus(snapshot)
    for round_number in range(2000):
        node = f"n{round_number % 4}"
        taken = free.reserve_any(node, 3)
        assert free.release(node, taken)
        copy = free.copy()
    assert sum(len(heap) for heap in copy._smallest.values()) <= 2 * 4 + 8 * len(copy._smallest)
    assert copy.tightest(3) == "n0" and copy.total == 32
    assert not free.release("n0", (0,))  # not taken: refused, nothing changed
    assert not free.release("n0", (8,)) and free.total == 32  # no such GPU
