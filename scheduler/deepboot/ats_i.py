"""DeepBoot ATS-I: put one pending inference task on a GPU of the inference pool.

In order of preference (the first that exists wins):

1. ``reuse`` — a warm replica of the task's application (PROTECT first, then SLEEP) whose GPU
   is not lent: no cold start;
2. ``free`` — a GPU with no replica and no training job, on the node with the fewest lent
   training GPUs (DeepBoot's node order: it keeps training off the nodes inference needs);
3. ``sleep`` — the GPU of a SLEEP replica of another application (that replica ends; the
   oldest sleeper on the least-lent node first);
4. ``reclaim`` — one lent GPU back from a training job: the (job, node) whose loss of speedup
   is smallest. The job keeps its other GPUs (an AFE resize, whose cost discounts its new
   speedup) or, below its ``min_gpus``, stops and loses its whole speedup;
5. ``evict`` — the GPU of a PROTECT replica of another application: warm but idle, so ending
   it (the oldest protected one first; it would have slept soonest) beats making the task
   wait. DeepBoot keeps protected replicas from *training*; against a waiting task of
   another model a protect time only buys a possible future reuse;
6. ``wait`` — every inference GPU is RUNNING: nothing idle is left in the pool.

Everything is a pure function of the snapshot (its ``current`` plan says which inference
GPUs training holds) and the live replicas; :func:`place_inference_tasks` repeats the
choice for several pending tasks, each seeing the previous ones' effects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from scheduler.deepboot.costs import ResizeCosts, kept_share
from scheduler.deepboot.lending import BOTH_POOLS
from scheduler.deepboot.state import ReplicaState, ReplicaView
from scheduler.policies.pollux_estimates import JobTable, gpus_per_node
from scheduler.policy import Allocation, ClusterSnapshot, Plan

Kind = Literal["reuse", "free", "sleep", "reclaim", "evict", "wait"]


@dataclass(frozen=True)
class InferenceDecision:
    """Where one task goes, and what has to give way for it."""

    application: str
    kind: Kind
    node: str = ""                              # inference node of the task's GPU ("" when waiting)
    gpu: int = -1
    replica_id: str = ""                        # reuse: the warm replica taken; sleep / evict: the replica to end
    job_id: str = ""                            # reclaim: the training job that gives the GPU back
    job_allocation: Allocation | None = None    # reclaim: that job's allocation afterwards (empty = stopped)
    loss: float = 0.0                           # reclaim: speedup the job loses (penalized)

    @property
    def cold_start(self) -> bool:
        """The task starts a new replica (pays the application's start-up time)."""
        return self.kind in ("free", "sleep", "reclaim", "evict")


@dataclass(frozen=True)
class InferenceRound:
    """The result of placing several tasks in turn."""

    decisions: tuple[InferenceDecision, ...]   # one per task, in the order given
    plan: Plan                                 # the training plan after the reclaims
    replicas: tuple[ReplicaView, ...]          # live replicas afterwards; new ones have ids "new-<k>"


def place_inference_task(
    snapshot: ClusterSnapshot,
    application: str,
    replicas: Sequence[ReplicaView],
    *,
    costs: ResizeCosts = ResizeCosts(),
    penalty_rounds: float = 2.0,
) -> InferenceDecision:
    """Choose the GPU for one task of ``application`` (see the module docstring for the order)."""
    sizes = {node.name: node.gpus for node in snapshot.nodes if node.pool == "inference"}
    active = {job.job_id for job in snapshot.jobs}
    lent: dict[tuple[str, int], str] = {}
    for job_id, allocation in sorted(snapshot.current.allocations.items()):
        if job_id in active:
            for node, indices in allocation.placement:
                if node in sizes:  # indices beyond the node (a stale plan) are nobody's to give back
                    lent.update({(node, i): job_id for i in indices if 0 <= i < sizes[node]})
    training_on = {name: 0 for name in sizes}
    for node, _ in lent:
        training_on[node] += 1
    live = [r for r in replicas if r.state is not ReplicaState.END and r.node in sizes and 0 <= r.gpu < sizes[r.node]]
    occupied = {(r.node, r.gpu) for r in live}

    warm = [r for r in live if r.application == application and r.state.warm and (r.node, r.gpu) not in lent]
    if warm:
        r = min(warm, key=lambda r: (r.state is ReplicaState.SLEEP, training_on[r.node], r.node, r.gpu))
        return InferenceDecision(application, "reuse", r.node, r.gpu, replica_id=r.replica_id)

    free = [(node, i) for node, size in sizes.items() for i in range(size) if (node, i) not in lent and (node, i) not in occupied]
    if free:
        node, gpu = min(free, key=lambda slot: (training_on[slot[0]], slot))
        return InferenceDecision(application, "free", node, gpu)

    sleeping = [r for r in live if r.state is ReplicaState.SLEEP and (r.node, r.gpu) not in lent]
    if sleeping:
        r = min(sleeping, key=lambda r: (training_on[r.node], r.since_s, r.node, r.gpu))
        return InferenceDecision(application, "sleep", r.node, r.gpu, replica_id=r.replica_id)

    candidates = reclaim_candidates(snapshot, lent, occupied, costs=costs, penalty_rounds=penalty_rounds)
    if candidates:
        best = min(candidates, key=lambda c: (c.loss, training_on[c.node], c.job_id, c.node, c.gpu))
        return dataclasses.replace(best, application=application)

    protected = [r for r in live if r.state is ReplicaState.PROTECT and (r.node, r.gpu) not in lent]
    if protected:  # none is of this application (it would have been reused)
        r = min(protected, key=lambda r: (r.since_s, training_on[r.node], r.node, r.gpu))
        return InferenceDecision(application, "evict", r.node, r.gpu, replica_id=r.replica_id)
    return InferenceDecision(application, "wait")


def reclaim_candidates(
    snapshot: ClusterSnapshot,
    lent: dict[tuple[str, int], str],
    occupied: set[tuple[str, int]],
    *,
    costs: ResizeCosts,
    penalty_rounds: float,
) -> list[InferenceDecision]:
    """Every way of taking one lent GPU back: per (job, inference node) its highest lent index, priced.

    The loss is the job's speedup now minus its speedup on the GPUs it keeps, discounted by
    the share of ``penalty_rounds x interval_s`` its AFE resize costs; a job left below its
    ``min_gpus`` stops and loses everything it had.
    """
    jobs = {job.job_id: job for job in snapshot.jobs}
    choice: dict[tuple[str, str], int] = {}
    for (node, gpu), job_id in lent.items():
        if (node, gpu) not in occupied:  # a replica claiming a lent GPU is a conflict, not a candidate
            choice[(job_id, node)] = max(gpu, choice.get((job_id, node), -1))
    if not choice:
        return []
    position = {job_id: k for k, job_id in enumerate(jobs)}
    table = JobTable(list(jobs.values()))
    per_node = gpus_per_node(snapshot, BOTH_POOLS)
    keys = sorted(choice)
    rows, now_gpus, now_nodes, new_gpus, new_nodes, remaining = [], [], [], [], [], []
    for job_id, node in keys:
        placement = snapshot.current.get(job_id).placement
        kept = tuple((n, tuple(i for i in ix if (n, i) != (node, choice[(job_id, node)]))) for n, ix in placement)
        kept = tuple((n, ix) for n, ix in kept if ix)
        rows.append(position[job_id])
        now_gpus.append(sum(len(ix) for _, ix in placement))
        now_nodes.append(len(placement))
        new_gpus.append(sum(len(ix) for _, ix in kept))
        new_nodes.append(len(kept))
        remaining.append(kept)
    rows = np.array(rows)
    before = table.predict(rows, np.array(now_gpus), np.array(now_nodes), per_node=per_node)
    after = table.predict(rows, np.array(new_gpus), np.array(new_nodes), per_node=per_node)
    horizon = penalty_rounds * snapshot.interval_s
    result = []
    for k, (job_id, node) in enumerate(keys):
        job = jobs[job_id]
        if new_gpus[k] >= job.min_gpus and new_gpus[k] > 0:
            share = kept_share(costs.cost_s(job, starting=False, default_s=snapshot.restart_cost_s), horizon, starting=False)
            allocation = Allocation(placement=remaining[k], batch_size=int(after.batch_size[k]))
            loss = float(before.speedup[k] - share * after.speedup[k])
        else:
            allocation, loss = Allocation(), float(before.speedup[k])
        result.append(InferenceDecision("", "reclaim", node, choice[(job_id, node)], job_id=job_id, job_allocation=allocation, loss=loss))
    return result


def place_inference_tasks(
    snapshot: ClusterSnapshot,
    applications: Sequence[str],
    replicas: Sequence[ReplicaView],
    *,
    costs: ResizeCosts = ResizeCosts(),
    penalty_rounds: float = 2.0,
) -> InferenceRound:
    """Place pending tasks (their applications, in queue order) one after another."""
    live = list(replicas)
    plan = dict(snapshot.current.allocations)
    decisions = []
    for k, application in enumerate(applications):
        view = dataclasses.replace(snapshot, current=Plan(plan))
        decision = place_inference_task(view, application, live, costs=costs, penalty_rounds=penalty_rounds)
        decisions.append(decision)
        if decision.kind == "wait":
            continue
        if decision.kind in ("reuse", "sleep", "evict"):
            live = [r for r in live if r.replica_id != decision.replica_id]
        if decision.kind == "reclaim":
            if decision.job_allocation.placement:
                plan[decision.job_id] = decision.job_allocation
            else:
                plan.pop(decision.job_id)
        replica_id = decision.replica_id if decision.kind == "reuse" else f"new-{k}"
        live.append(ReplicaView(replica_id, application, decision.node, decision.gpu, ReplicaState.RUNNING, snapshot.time_s))
    return InferenceRound(tuple(decisions), Plan(plan), tuple(live))
