"""deepboot ATS-I: where an inference task goes — warm replica, free GPU, sleeping replica, reclaimed training GPU."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.deepboot.ats_i import place_inference_task, place_inference_tasks
from scheduler.deepboot.state import ReplicaState, ReplicaView, busy_gpus
from scheduler.invariants import check_plan
from scheduler.policies.pollux_estimates import JobTable
from tests.scheduler.conftest import make_job, make_nodes, make_snapshot

RUNNING, PROTECT, SLEEP = ReplicaState.RUNNING, ReplicaState.PROTECT, ReplicaState.SLEEP
A, B, C = "infer-bert-1", "infer-ncf-1", "infer-yolov3-1"


def cluster():
    """One training node n0 and inference nodes i0, i1, all of 2 GPUs."""
    return make_nodes(1, 2) + make_nodes(2, 2, pool="inference")


def replica(replica_id, application, node, gpu, state, since=0.0):
    return ReplicaView(replica_id, application, node, gpu, state, since)


def test_a_warm_replica_of_the_application_beats_a_free_gpu_protect_first():
    snap = make_snapshot(cluster(), [])
    protect = replica("p", A, "i1", 0, PROTECT)
    sleeping = replica("s", A, "i0", 0, SLEEP)
    decision = place_inference_task(snap, A, [sleeping, protect])
    assert (decision.kind, decision.replica_id, decision.node, decision.gpu) == ("reuse", "p", "i1", 0)
    assert not decision.cold_start
    assert place_inference_task(snap, A, [sleeping]).replica_id == "s"   # a sleeper of A is still warm
    assert place_inference_task(snap, B, [protect]).kind == "free"      # warm for another application only


def test_a_free_gpu_goes_on_the_node_with_fewest_lent_training_gpus():
    # i0 lends GPU 0 to job j; i1 lends nothing: i1:0 first, although i0:1 is free too.
    job = make_job("j", gpus=1)
    snap = make_snapshot(cluster(), [job], current={"j": [("i0", (0,))]})
    decision = place_inference_task(snap, A, [])
    assert (decision.kind, decision.node, decision.gpu) == ("free", "i1", 0)
    assert decision.cold_start


def test_without_free_gpus_the_oldest_sleeper_of_another_application_gives_way():
    replicas = [
        replica("run", B, "i0", 0, RUNNING),
        replica("prot", B, "i0", 1, PROTECT),
        replica("s-new", B, "i1", 0, SLEEP, since=50.0),
        replica("s-old", C, "i1", 1, SLEEP, since=10.0),
    ]
    snap = make_snapshot(cluster(), [])
    decision = place_inference_task(snap, A, replicas)
    assert (decision.kind, decision.replica_id, decision.node, decision.gpu) == ("sleep", "s-old", "i1", 1)


def test_running_replicas_are_never_taken_and_a_task_waits_only_when_all_run():
    replicas = [replica(f"r{k}", B, node, gpu, RUNNING) for k, (node, gpu) in enumerate(
        [("i0", 0), ("i0", 1), ("i1", 0), ("i1", 1)])]
    snap = make_snapshot(cluster(), [])
    assert place_inference_task(snap, A, replicas).kind == "wait"


def test_another_applications_protected_replica_gives_way_before_a_task_waits():
    # Nothing free, asleep or lent: the oldest PROTECT replica of another application ends (a cold start).
    replicas = [
        replica("run", B, "i0", 0, RUNNING),
        replica("p-new", B, "i0", 1, PROTECT, since=50.0),
        replica("p-old", C, "i1", 0, PROTECT, since=10.0),
        replica("run2", C, "i1", 1, RUNNING),
    ]
    snap = make_snapshot(cluster(), [])
    decision = place_inference_task(snap, A, replicas)
    assert (decision.kind, decision.replica_id, decision.node, decision.gpu) == ("evict", "p-old", "i1", 0)
    assert decision.cold_start
    # A lent GPU is taken back first: protected replicas stay warm while training can give way.
    job = make_job("e", gpus=2, min_gpus=1, max_gpus=4)
    lent = make_snapshot(cluster(), [job], current={"e": [("i1", (1,)), ("n0", (0,))]})
    assert place_inference_task(lent, A, replicas[:3]).kind == "reclaim"
    # In turn: the two protected replicas go, then the third task waits (all four GPUs RUNNING).
    result = place_inference_tasks(snap, [A, A, A], replicas)
    assert [(d.kind, d.replica_id) for d in result.decisions] == [("evict", "p-old"), ("evict", "p-new"), ("wait", "")]
    assert all(r.state is RUNNING for r in result.replicas) and len(result.replicas) == 4


def test_the_pool_ends_an_evicted_replica_and_cold_starts_a_new_one():
    from scheduler.deepboot.replicas import InferencePool, LifecycleConfig

    pool = InferencePool(LifecycleConfig())
    first = place_inference_task(make_snapshot(cluster(), []), B, [])
    old_id, finish = pool.start(first, _Task("t0", B, 2.0), 0.0)
    pool.finish(old_id, finish)  # PROTECT now
    busy = [replica(f"x{k}", C, node, gpu, RUNNING) for k, (node, gpu) in enumerate([("i0", 1), ("i1", 0), ("i1", 1)])]
    decision = place_inference_task(make_snapshot(cluster(), [], time=finish + 1), A, list(pool.views(finish + 1)) + busy)
    assert decision.kind == "evict" and decision.replica_id == old_id
    new_id, done = pool.start(decision, _Task("t1", A, 5.0), finish + 1)
    assert [v.replica_id for v in pool.views(finish + 1)] == [new_id]
    assert done == pytest.approx(finish + 1 + LifecycleConfig().cold_start(A) + 5.0)


@dataclasses.dataclass(frozen=True)
class _Task:
    name: str
    application: str
    duration_s: float


def test_reclaim_takes_the_gpu_whose_job_loses_least():
    # i0:0 runs inference, i0:1 is lent to rigid 1-GPU job r; i1 is lent to elastic job e (1..4 GPUs).
    rigid = make_job("r", gpus=1)
    flexible = make_job("e", gpus=2, min_gpus=1, max_gpus=4)
    snap = make_snapshot(cluster(), [rigid, flexible], current={"r": [("i0", (1,))], "e": [("i1", (0, 1))]}, interval_s=60.0)
    decision = place_inference_task(snap, A, [replica("x", B, "i0", 0, RUNNING)])
    # r would stop: it loses its whole speedup, 1.0 (one GPU is the base). e shrinks from 2 GPUs
    # to 1 with an AFE resize of 3 s out of 2 x 60 s: loses s(2) - 117/120 x s(1) = s(2) - 0.975.
    s2 = JobTable([flexible]).predict([0], [2], [1], per_node=2).speedup[0]
    assert (decision.kind, decision.job_id, decision.node, decision.gpu) == ("reclaim", "e", "i1", 1)
    assert decision.loss == pytest.approx(s2 - 117 / 120 * 1.0)
    assert decision.loss < 1.0
    assert decision.job_allocation.placement == (("i1", (0,)),)
    # With e gone, r is the only lender: it stops (empty allocation) and loses exactly 1.
    only_rigid = dataclasses.replace(snap, jobs=(rigid,))
    stop = place_inference_task(only_rigid, A, [replica("x", B, "i0", 0, RUNNING), replica("y", B, "i1", 0, RUNNING), replica("z", B, "i1", 1, RUNNING)])
    assert (stop.kind, stop.job_id, stop.job_allocation.placement) == ("reclaim", "r", ())
    assert stop.loss == pytest.approx(1.0)


def test_pending_tasks_are_placed_in_turn_each_seeing_the_last():
    job = make_job("e", gpus=2, min_gpus=1, max_gpus=4)
    replicas = [replica("run", B, "i0", 0, RUNNING), replica("zz", C, "i0", 1, SLEEP)]
    snap = make_snapshot(cluster(), [job], current={"e": [("i1", (0,)), ("n0", (0,))]})
    result = place_inference_tasks(snap, [A, A, A, A], replicas)
    # i1:1 free, then the sleeper i0:1, then e's lent GPU i1:0; the fourth task finds nothing.
    assert [(d.kind, d.node, d.gpu) for d in result.decisions] == [
        ("free", "i1", 1), ("sleep", "i0", 1), ("reclaim", "i1", 0), ("wait", "", -1)]
    assert result.plan.get("e").placement == (("n0", (0,)),)
    assert busy_gpus(result.replicas) == {"i0": (0, 1), "i1": (0, 1)}
    assert "zz" not in {r.replica_id for r in result.replicas}


# -- invariants on random small states ----------------------------------------------------------


@st.composite
def inference_states(draw):
    """Inference nodes whose GPUs are each free, lent to a training job, or held by a replica."""
    nodes = make_nodes(1, 2) + tuple(
        dataclasses.replace(node, gpus=draw(st.integers(1, 3))) for node in make_nodes(draw(st.integers(1, 2)), pool="inference"))
    jobs = [make_job(f"j{k}", draw(st.sampled_from(["cifar10", "bert"])), gpus=1, min_gpus=draw(st.integers(1, 2)), max_gpus=8) for k in range(3)]
    held: dict[str, list[tuple[str, int]]] = {}
    replicas = []
    for node in nodes:
        for gpu in range(node.gpus):
            what = draw(st.sampled_from(["free", "lent", "lent", "running", "protect", "sleep"]))
            if what == "lent" or node.pool == "training":
                if draw(st.booleans()) or node.pool == "inference":
                    held.setdefault(draw(st.sampled_from([j.job_id for j in jobs])), []).append((node.name, gpu))
            elif what != "free":
                replicas.append(replica(f"r{len(replicas)}", draw(st.sampled_from([A, B])), node.name, gpu,
                                        ReplicaState(what), since=draw(st.floats(0, 100))))
    current = {}
    for job in list(jobs):
        slots = held.get(job.job_id, [])
        if len(slots) < job.min_gpus:  # below its minimum it would not be running: drop it, GPUs idle
            continue
        by_node: dict[str, list[int]] = {}
        for node, gpu in slots:
            by_node.setdefault(node, []).append(gpu)
        current[job.job_id] = list(by_node.items())
    snap = make_snapshot(nodes, jobs, current=current)
    return snap, replicas, draw(st.lists(st.sampled_from([A, B, C]), min_size=1, max_size=4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inference_states())
def test_preference_order_and_no_idle_lendable_gpu_while_a_task_waits(state):
    snap, replicas, pending = state
    inference = {n.name for n in snap.nodes if n.pool == "inference"}
    lent = {(node, i) for a in snap.current.allocations.values() for node, ix in a.placement if node in inference for i in ix}
    taken = {(r.node, r.gpu) for r in replicas}
    free = {(n.name, i) for n in snap.nodes if n.pool == "inference" for i in range(n.gpus)} - lent - taken
    application = pending[0]
    decision = place_inference_task(snap, application, replicas)
    if any(r.application == application and r.state.warm for r in replicas):
        expected = "reuse"
    elif free:
        expected = "free"
    elif any(r.state is SLEEP for r in replicas):
        expected = "sleep"
    elif lent:
        expected = "reclaim"
    elif any(r.state is PROTECT for r in replicas):
        expected = "evict"  # another application's idle protected replica, before anyone waits
    else:
        expected = "wait"  # every inference GPU RUNNING: nothing idle exists
    assert decision.kind == expected
    if decision.kind != "wait":
        blocking = {(r.node, r.gpu) for r in replicas if r.state.holds_gpu and r.replica_id != decision.replica_id}
        assert (decision.node, decision.gpu) not in blocking   # never a RUNNING or PROTECT GPU of another
        if decision.kind == "evict":
            ended = next(r for r in replicas if r.replica_id == decision.replica_id)
            assert ended.state is PROTECT and ended.application != application


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inference_states())
def test_no_gpu_is_held_twice_across_pools_after_a_round(state):
    snap, replicas, pending = state
    result = place_inference_tasks(snap, pending, replicas)
    check_plan(snap, result.plan)
    slots = [(r.node, r.gpu) for r in result.replicas]
    assert len(slots) == len(set(slots))  # one replica per GPU
    training = {(node, i) for a in result.plan.allocations.values() for node, ix in a.placement for i in ix}
    running = {(r.node, r.gpu) for r in result.replicas if r.state is RUNNING}
    assert not training & running
    # Every placed task holds a RUNNING replica; one that waited left a cluster with nothing idle.
    placed = [d for d in result.decisions if d.kind != "wait"]
    assert len(running) >= len(placed)
    if len(placed) < len(pending):
        inference_slots = {(n.name, i) for n in snap.nodes if n.pool == "inference" for i in range(n.gpus)}
        assert inference_slots <= running
