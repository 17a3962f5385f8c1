"""ATS-T, ATS-I and the replica pool driven together, the way an engine would (docs/policies.md, DeepBoot).

A one-second time-stepped loop over a small mixed cluster: a training round every 60 s,
inference tasks placed as they arrive and as GPUs free up. After every step no GPU has two
holders, and a queued task means no inference GPU is lendable.
"""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.deepboot.state import ReplicaState
from scheduler.invariants import check_plan
from scheduler.policy import Plan
from scheduler.registry import get_policy
from simulator.inference import ArrivalPattern, InferencePool, generate_inference_tasks
from tests.scheduler.conftest import make_job, make_nodes, make_snapshot


def holders(plan: Plan, pool: InferencePool, now: float) -> dict[tuple[str, int], list[str]]:
    """GPU -> who holds it: training jobs, and replicas that are not ended."""
    held: dict[tuple[str, int], list[str]] = {}
    for job_id, allocation in plan.allocations.items():
        for node, indices in allocation.placement:
            for i in indices:
                held.setdefault((node, i), []).append(job_id)
    for view in pool.views(now):
        held.setdefault((view.node, view.gpu), []).append(view.replica_id)
    return held


@pytest.mark.parametrize("kind", ["steady", "bursty"])
def test_training_and_inference_share_gpus_without_double_booking(kind):
    nodes = make_nodes(1, 4) + make_nodes(2, 2, pool="inference")
    inference_slots = {(n.name, i) for n in nodes if n.pool == "inference" for i in range(n.gpus)}
    jobs = [make_job(f"j{k}", app, gpus=1, min_gpus=1, max_gpus=8) for k, app in enumerate(["cifar10", "ncf"])]
    tasks = generate_inference_tasks(seed=5, horizon_s=900, pattern=ArrivalPattern(kind, rate_per_s=0.04, mean_burst_s=30))
    policy = get_policy("deepboot")
    pool = InferencePool()
    plan, queue, running = Plan(), [], {}  # running: replica id -> (finish time, task)
    lent_peak = reclaims = reuses = 0
    arrivals = list(tasks)
    for now in range(0, 900):
        now = float(now)
        for replica_id, (finish, _) in list(running.items()):
            if finish <= now:
                pool.finish(replica_id, now)
                del running[replica_id]
        while arrivals and arrivals[0].arrival_s <= now:
            queue.append(arrivals.pop(0))
        snapshot = make_snapshot(nodes, jobs, time=now, current=plan, inference_busy=pool.busy(now))
        if now % 60 == 0:
            plan = policy.schedule(snapshot)
            pool.end_lent(plan, now)
            snapshot = dataclasses.replace(snapshot, current=plan, inference_busy=pool.busy(now))
            lent_peak = max(lent_peak, sum(1 for a in plan.allocations.values() for n, ix in a.placement if n.startswith("i") for _ in ix))
        if queue:
            result = policy.place_inference(snapshot, [t.application for t in queue], pool.views(now))
            waiting = []
            for task, decision in zip(queue, result.decisions):
                if decision.kind == "wait":
                    waiting.append(task)
                    continue
                if decision.kind == "reclaim":
                    reclaims += 1
                    allocations = dict(plan.allocations)
                    if decision.job_allocation.placement:
                        allocations[decision.job_id] = decision.job_allocation
                    else:
                        del allocations[decision.job_id]
                    plan = Plan(allocations)
                reuses += decision.kind == "reuse"
                replica_id, finish = pool.start(decision, task, now)
                running[replica_id] = (finish, task)
            queue = waiting
        check_plan(snapshot, plan)
        doubled = {gpu: who for gpu, who in holders(plan, pool, now).items() if len(who) > 1}
        assert not doubled, f"t={now}: {doubled}"
        if queue:  # a task waits only when every inference GPU is RUNNING (idle PROTECT replicas give way)
            held = {(v.node, v.gpu) for v in pool.views(now) if v.state is ReplicaState.RUNNING}
            assert inference_slots <= held, f"t={now}: {len(queue)} queued with lendable GPUs"
    # The scenario exercised what it is about: lending, warm reuse and reclaiming.
    assert lent_peak > 0 and reuses > 0 and reclaims > 0
    assert all(v.state is not ReplicaState.END for v in pool.views(900.0))
