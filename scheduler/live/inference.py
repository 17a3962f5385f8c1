"""Inference tasks on the live cluster: DeepBoot's ATS-I beside the training policy.

Inference jobs (``JobSpec.kind = INFERENCE``: one GPU of the inference pool for a while) are
not given to the training policy. Around each round, :class:`LiveInference`:

1. finishes the replicas whose task is no longer active (RUNNING -> PROTECT); replicas age
   into SLEEP and END on their own (:mod:`scheduler.deepboot.replicas`, wall-clock seconds);
2. tells the training snapshot which inference GPUs are busy (RUNNING and PROTECT replicas),
   so a lending policy (``deepboot``) borrows only idle and sleeping ones;
3. after the policy: ends the SLEEP replicas whose GPU the training plan takes, keeps every
   running task on its replica's GPU, and places pending tasks in arrival order with ATS-I
   (a warm replica of the application, a free GPU, a sleeper's GPU, or one lent GPU reclaimed
   from the training job that loses least);
4. describes the replicas and the loans for the plan, which is how they survive a scheduler
   restart (:meth:`restore`).

A task is an ordinary job allocation of one GPU, so the agents launch it and the scheduler's
release-before-reuse and task reports apply to it as to training ranks. The replica the plan
lists on that GPU is RUNNING for that very task. The live agents do not emulate the cold
start of a new replica yet (the simulator does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from scheduler.deepboot.ats_i import place_inference_tasks
from scheduler.deepboot.costs import ResizeCosts
from scheduler.deepboot.replicas import InferencePool, LifecycleConfig, Replica, is_inference
from scheduler.deepboot.state import ReplicaState, ReplicaView
from scheduler.policy import Allocation, ClusterSnapshot, Plan
from silod.v1 import common_pb2, plan_pb2

_STATE_TO_PROTO = {
    ReplicaState.RUNNING: plan_pb2.REPLICA_STATE_RUNNING,
    ReplicaState.PROTECT: plan_pb2.REPLICA_STATE_PROTECT,
    ReplicaState.SLEEP: plan_pb2.REPLICA_STATE_SLEEP,
    ReplicaState.END: plan_pb2.REPLICA_STATE_END,
}


def is_inference_job(job: common_pb2.Job) -> bool:
    return job.spec.kind == common_pb2.JOB_KIND_INFERENCE


@dataclass(frozen=True)
class _Task:
    name: str
    application: str
    duration_s: float = 0.0  # unknown ahead: the task's own exit ends it


class LiveInference:
    def __init__(self, policy: object, config: LifecycleConfig = LifecycleConfig(),
                 clock=time.time) -> None:  # type: ignore[no-untyped-def]
        self.pool = InferencePool(config)
        self.clock = clock
        self.task_replica: dict[str, str] = {}  # inference job id -> replica serving it
        # A lending policy prices reclaims with its own resize costs; others use the defaults.
        self.costs: ResizeCosts = getattr(policy, "costs", ResizeCosts())
        self.penalty_rounds: float = getattr(policy, "penalty_rounds", 2.0)

    # ---- before the policy ---------------------------------------------------------------
    def busy(self, inference_jobs: Sequence[common_pb2.Job]) -> dict[str, tuple[int, ...]]:
        """Finish replicas whose task ended; the inference GPUs training must not take."""
        now = self.clock()
        active = {job.id for job in inference_jobs}
        for job_id, replica_id in list(self.task_replica.items()):
            if job_id not in active:
                del self.task_replica[job_id]
                if self.pool.replica(replica_id).state(now) is ReplicaState.RUNNING:
                    self.pool.finish(replica_id, now)
        return self.pool.busy(now)

    # ---- after the policy ----------------------------------------------------------------
    def place(self, snapshot: ClusterSnapshot, training: Plan, inference_jobs: Sequence[common_pb2.Job],
              unusable: Mapping[str, frozenset[int]] = {}) -> Plan:  # noqa: B006 - read only
        """``training`` plus every inference task's GPU; reclaims shrink training allocations.
        ``unusable``: node -> faulted GPUs (scheduler.live.gpu_health); a task running on one is
        placed anew, and no task goes to one."""
        now = self.clock()
        self.pool.end_lent(training, now)
        if not inference_jobs and not self.task_replica:
            return training  # nothing to add: the training plan as it is (its change hint too)
        allocations = dict(training.allocations)
        for job_id, replica_id in list(self.task_replica.items()):
            replica = self.pool.replica(replica_id)
            if replica.gpu in unusable.get(replica.node, ()):
                del self.task_replica[job_id]
                if replica.state(now) is ReplicaState.RUNNING:
                    self.pool.finish(replica_id, now)
        for job in inference_jobs:
            replica_id = self.task_replica.get(job.id)
            if replica_id is not None:
                replica = self.pool.replica(replica_id)
                allocations[job.id] = Allocation(placement=((replica.node, (replica.gpu,)),), batch_size=1)
        pending = [job for job in inference_jobs if job.id not in self.task_replica and is_inference(job.spec.application)]
        if not pending:
            return Plan(allocations)
        view = dataclasses.replace(snapshot, current=training)
        # A faulted GPU looks to ATS-I like one a replica serves on: never free, reused or evicted.
        replicas = [r for r in self.pool.views(now) if r.gpu not in unusable.get(r.node, ())] + [
            ReplicaView(f"gpu-fault/{node}/{gpu}", "", node, gpu, ReplicaState.RUNNING)
            for node, gpus in unusable.items() for gpu in sorted(gpus)]
        decided = place_inference_tasks(view, [job.spec.application for job in pending], replicas,
                                        costs=self.costs, penalty_rounds=self.penalty_rounds)
        for job, decision in zip(pending, decided.decisions):
            if decision.kind == "wait":
                continue  # every inference GPU is running or protected: nothing idle is withheld
            if decision.kind == "reclaim":
                if decision.job_allocation is not None and decision.job_allocation.placement:
                    allocations[decision.job_id] = decision.job_allocation
                else:
                    allocations.pop(decision.job_id, None)
            replica_id, _ = self.pool.start(decision, _Task(job.id, job.spec.application), now)
            self.task_replica[job.id] = replica_id
            allocations[job.id] = Allocation(placement=((decision.node, (decision.gpu,)),), batch_size=1)
        return Plan(allocations)

    # ---- the plan's record ---------------------------------------------------------------
    def describe(self, plan: plan_pb2.AllocationPlan, inference_nodes: set[str]) -> None:
        """Add the live replicas and the loans (training ranks on inference nodes) to ``plan``."""
        now = self.clock()
        serving = {replica_id: job_id for job_id, replica_id in self.task_replica.items()}
        for view in self.pool.views(now):
            replica = self.pool.replica(view.replica_id)
            entry = plan.replicas.add(replica_id=view.replica_id, application=view.application, node=view.node,
                                      gpu_index=view.gpu, state=_STATE_TO_PROTO[view.state],
                                      task_id=serving.get(view.replica_id, ""), reuse_count=replica.reuses)
            if view.state is ReplicaState.PROTECT and replica.next_change_s() < float("inf"):
                entry.protect_until.CopyFrom(_timestamp(replica.next_change_s()))
        if not inference_nodes:
            return  # nothing to lend: no pass over every job's entry
        inference_jobs = set(self.task_replica)
        for job in plan.jobs:
            if job.job_id in inference_jobs:
                continue
            for placement in job.placements:
                if placement.node in inference_nodes:
                    for gpu in placement.gpu_indices:
                        plan.loans.add(node=placement.node, gpu_index=gpu, job_id=job.job_id)

    def restore(self, plan: plan_pb2.AllocationPlan | None, active_jobs: set[str]) -> None:
        """Rebuild the replicas after a restart from the latest plan (warm ones start a new protect time)."""
        if plan is None:
            return
        now = self.clock()
        for entry in plan.replicas:
            if entry.state == plan_pb2.REPLICA_STATE_END or not is_inference(entry.application):
                continue
            replica = Replica(entry.replica_id, entry.application, entry.node, entry.gpu_index, now=now,
                              config=self.pool.config)
            replica.reuses = entry.reuse_count
            self.pool.adopt(replica)
            if entry.state == plan_pb2.REPLICA_STATE_RUNNING and entry.task_id in active_jobs:
                self.task_replica[entry.task_id] = entry.replica_id
            else:
                replica.finish(now)  # its task ended while no scheduler watched: warm again


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
