"""scheduler.live.inference: inference tasks beside the deepboot training policy, over an injected clock."""

from __future__ import annotations

import dataclasses

from estimator.job_model import JobModel
from scheduler.invariants import check_plan
from scheduler.live.inference import LiveInference
from scheduler.policy import ClusterSnapshot, JobInfo, NodeInfo, Plan
from scheduler.registry import get_policy
from silod.v1 import common_pb2, plan_pb2

NODES = (NodeInfo("infer-0", 2, pool="inference"), NodeInfo("train-0", 2))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _training_job() -> JobInfo:
    return JobInfo(job_id="train", model=JobModel.from_profile("cifar10"), submit_time_s=0.0, min_gpus=1,
                   max_gpus=4, target_samples=5e6, requested_gpus=4)


def _task(job_id: str, application: str = "infer-resnet50-1") -> common_pb2.Job:
    return common_pb2.Job(id=job_id, spec=common_pb2.JobSpec(
        kind=common_pb2.JOB_KIND_INFERENCE, application=application, min_gpus=1, max_gpus=1, inference_duration_s=5))


def _round(live: LiveInference, policy, current: Plan, tasks: list[common_pb2.Job], clock: Clock) -> tuple[Plan, ClusterSnapshot]:  # type: ignore[no-untyped-def]
    busy = live.busy(tasks)
    snapshot = ClusterSnapshot(time_s=clock(), nodes=NODES, jobs=(_training_job(),), current=current,
                               restart_cost_s=10, interval_s=30, inference_busy=busy)
    training = policy.schedule(snapshot)
    check_plan(snapshot, training)
    return live.place(snapshot, training, tasks), snapshot


def _gpus(plan: Plan, job_id: str) -> set[tuple[str, int]]:
    allocation = plan.get(job_id)
    return {(n, i) for n, idx in allocation.placement for i in idx} if allocation else set()


def _proto(plan: Plan, live: LiveInference) -> plan_pb2.AllocationPlan:
    proto = plan_pb2.AllocationPlan(version=1)
    for job_id, allocation in sorted(plan.allocations.items()):
        entry = proto.jobs.add(job_id=job_id)
        for node, idx in allocation.placement:
            entry.placements.add(node=node, gpu_indices=list(idx))
    live.describe(proto, {"infer-0"})
    return proto


def test_idle_inference_gpus_are_lent_then_reclaimed_protected_and_lent_again() -> None:
    clock = Clock()
    # No resize hysteresis: growing back from 3 to 4 GPUs gains 26 %, less than the default
    # penalty (0.5 rounds on top of the AFE resize) asks for; this case is about lending.
    policy = get_policy("deepboot", resize_penalty_rounds=0.0)
    live = LiveInference(policy, clock=clock)

    plan, _ = _round(live, policy, Plan(), [], clock)
    assert len(_gpus(plan, "train")) == 4  # both idle inference GPUs are lent
    assert {(loan.node, loan.gpu_index) for loan in _proto(plan, live).loans} == {("infer-0", 0), ("infer-0", 1)}

    clock.now += 30
    plan, _ = _round(live, policy, plan, [_task("t1")], clock)
    held = _gpus(plan, "t1")
    assert len(held) == 1 and next(iter(held))[0] == "infer-0"
    assert not held & _gpus(plan, "train"), "the task's GPU was reclaimed from training"
    assert len(_gpus(plan, "train")) == 3
    proto = _proto(plan, live)
    (replica,) = proto.replicas
    assert replica.state == plan_pb2.REPLICA_STATE_RUNNING and replica.task_id == "t1"

    clock.now += 10  # the task finished: its replica is protected, so training may not take the GPU back
    plan, _ = _round(live, policy, plan, [], clock)
    assert held.isdisjoint(_gpus(plan, "train"))
    (replica,) = _proto(plan, live).replicas
    assert replica.state == plan_pb2.REPLICA_STATE_PROTECT and replica.HasField("protect_until")
    assert abs(replica.protect_until.ToNanoseconds() / 1e9 - (clock.now + 30)) < 1e-3  # 30 s on first use

    clock.now += 31  # protect time over: the replica sleeps, its GPU is lendable again
    plan, _ = _round(live, policy, plan, [], clock)
    assert held <= _gpus(plan, "train")
    assert [r.state for r in _proto(plan, live).replicas] == []  # lent away: the sleeper ended


def test_a_task_reuses_the_warm_replica_of_its_application() -> None:
    clock = Clock()
    policy = get_policy("deepboot")
    live = LiveInference(policy, clock=clock)
    plan, _ = _round(live, policy, Plan(), [_task("t1")], clock)
    first = _gpus(plan, "t1")
    clock.now += 5
    plan, _ = _round(live, policy, plan, [], clock)  # t1 done -> PROTECT
    clock.now += 5
    plan, _ = _round(live, policy, plan, [_task("t2")], clock)
    assert _gpus(plan, "t2") == first
    (replica,) = _proto(plan, live).replicas
    assert replica.task_id == "t2" and replica.reuse_count == 1


def test_restore_rebuilds_running_and_warm_replicas_from_the_plan() -> None:
    clock = Clock()
    policy = get_policy("deepboot")
    live = LiveInference(policy, clock=clock)
    plan, _ = _round(live, policy, Plan(), [_task("t1"), _task("t2", "infer-bert-1")], clock)
    proto = _proto(plan, live)
    assert {r.task_id for r in proto.replicas} == {"t1", "t2"}

    restarted = LiveInference(policy, clock=clock)
    restarted.restore(proto, active_jobs={"t1"})  # t2 ended while the scheduler was down
    again, _ = _round(restarted, policy, dataclasses.replace(plan), [_task("t1")], clock)
    assert _gpus(again, "t1") == _gpus(plan, "t1")
    states = {r.application: r.state for r in _proto(again, restarted).replicas}
    assert states == {"infer-resnet50-1": plan_pb2.REPLICA_STATE_RUNNING, "infer-bert-1": plan_pb2.REPLICA_STATE_PROTECT}
    # New replicas never reuse a restored id.
    clock.now += 1
    third, _ = _round(restarted, policy, again, [_task("t1"), _task("t3", "infer-yolo-1")], clock)
    ids = [r.replica_id for r in _proto(third, restarted).replicas]
    assert len(ids) == len(set(ids))
