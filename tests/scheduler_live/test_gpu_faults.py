"""Faulted GPUs in the live scheduler (scheduler.live.gpu_health): the metadata service and the
scheduler serve in-process, the test acts as the agents, whose heartbeats carry the faults."""

from __future__ import annotations

import dataclasses

from estimator.job_model import JobModel
from scheduler.live.gpu_health import UsableGpus
from scheduler.live.inference import LiveInference
from scheduler.policy import Allocation, ClusterSnapshot, JobInfo, NodeInfo, Plan
from scheduler.registry import get_policy
from silod.v1 import allocation_pb2, common_pb2, metadata_pb2, scheduler_pb2
from tests.scheduler_live.harness import wait_for


def _fault(cluster, node: str, index: int, reason: str = "Xid 79") -> None:  # type: ignore[no-untyped-def]
    cluster.md.Heartbeat(metadata_pb2.HeartbeatRequest(node=node, gpu_faults=[
        common_pb2.GpuFault(index=index, reason=reason)]))


def _clear(cluster, node: str, index: int) -> None:  # type: ignore[no-untyped-def]
    cluster.md.ClearGpuFault(metadata_pb2.ClearGpuFaultRequest(node=node, gpu_index=index))


def _placement(plan, job_id: str) -> list[tuple[str, list[int]]]:  # type: ignore[no-untyped-def]
    return [(p.node, sorted(p.gpu_indices)) for e in plan.jobs if e.job_id == job_id for p in e.placements]


def _entry(plan, job_id: str):  # type: ignore[no-untyped-def]
    return next(e for e in plan.jobs if e.job_id == job_id)


def _running(cluster, plan, node: str, job_id: str) -> None:  # type: ignore[no-untyped-def]
    entry = _entry(plan, job_id)
    cluster.report(node, plan.version, *(allocation_pb2.TaskReport(
        job_id=job_id, rank=rank, generation=entry.generation, phase=allocation_pb2.TASK_PHASE_RUNNING,
        gpu_indices=[gpu]) for rank, gpu in enumerate(i for p in entry.placements for i in p.gpu_indices)))


def test_a_faulted_gpu_leaves_the_plan_its_job_moves_and_a_clear_brings_it_back(cluster) -> None:  # type: ignore[no-untyped-def]
    cluster.add_node("n1", gpus=4)
    job = cluster.submit("rigid", min_gpus=2, max_gpus=2)
    plan = cluster.round()
    before = _entry(plan, job.id)
    assert _placement(plan, job.id) == [("n1", [0, 1])]
    _running(cluster, plan, "n1", job.id)
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING

    _fault(cluster, "n1", 1)
    plan = cluster.round("gpu fault")
    # Off GPU 1, on two usable GPUs, in a new generation: every rank relaunches from the checkpoint.
    moved = _entry(plan, job.id)
    assert _placement(plan, job.id) == [("n1", [0, 2])]
    assert moved.generation > before.generation and not moved.fast_resize
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RESIZING

    # While GPU 1 is faulted, a job needing all four GPUs of the node waits.
    wide = cluster.submit("wide", min_gpus=4, max_gpus=4)
    _running(cluster, plan, "n1", job.id)
    plan = cluster.round()
    assert _placement(plan, wide.id) == [] and all(1 not in idx for e in plan.jobs for _, idx in _placement(plan, e.job_id))

    # The operator clears the fault: no restart of anything, the next rounds use GPU 1 again.
    cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
    _clear(cluster, "n1", 1)

    def placed():  # type: ignore[no-untyped-def]
        cluster.report("n1", cluster.latest().version)  # the agent: the cancelled job's ranks are gone
        plan = cluster.round()
        return _placement(plan, wide.id) and plan

    plan = wait_for(placed, timeout=20, what="the wide job placed once GPU 1 is back")
    assert _placement(plan, wide.id) == [("n1", [0, 1, 2, 3])]


def test_an_elastic_job_keeps_its_healthy_gpus(cluster) -> None:  # type: ignore[no-untyped-def]
    cluster.add_node("n1", gpus=4)
    job = cluster.submit("elastic", min_gpus=1, max_gpus=4)
    plan = cluster.round()
    assert _placement(plan, job.id) == [("n1", [0, 1, 2, 3])]
    _running(cluster, plan, "n1", job.id)
    _fault(cluster, "n1", 3, "5 uncorrectable ECC errors")
    plan = cluster.round("gpu fault")
    assert _placement(plan, job.id) == [("n1", [0, 1, 2])]


def test_the_node_watch_starts_a_round_when_a_gpu_faults(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster()  # the node watch polls every second
    cluster.add_node("n1", gpus=2)
    cluster.add_node("n2", gpus=2)
    job = cluster.submit("pair", min_gpus=2, max_gpus=2)
    plan = cluster.round()
    node = _placement(plan, job.id)[0][0]
    _running(cluster, plan, node, job.id)
    cluster.heartbeat("n1")
    cluster.heartbeat("n2")
    _fault(cluster, node, 0)
    other = "n2" if node == "n1" else "n1"
    # No explicit round: the scheduler's own node watch sees the fault (interval_s is 60 s here).
    wait_for(lambda: _placement(cluster.latest(), job.id) == [(other, [0, 1])], timeout=20,
             what="the job moved to the other node")


# ---- the policy's view and inference tasks, without services ---------------------------------

def _node(name: str, gpus: int, faults: tuple[int, ...] = (), pool: int = common_pb2.NODE_POOL_TRAINING) -> common_pb2.Node:
    return common_pb2.Node(spec=common_pb2.NodeSpec(name=name, gpus=gpus, pool=pool),
                           gpu_faults=[common_pb2.GpuFault(index=i, reason="Xid 48") for i in faults])


def test_the_policy_sees_only_usable_gpus_and_its_plan_maps_back() -> None:
    usable = UsableGpus([_node("a", 4, (1,)), _node("b", 2)])
    assert usable.faulted == {"a": frozenset({1})}
    assert usable.without_faulted((("a", (0, 1)), ("b", (0,)))) == (("a", (0,)), ("b", (0,)))
    assert usable.without_faulted((("a", (1,)),)) == ()
    job = JobInfo(job_id="j", model=JobModel.from_profile("cifar10"), submit_time_s=0.0, min_gpus=3, max_gpus=3,
                  target_samples=1e6, requested_gpus=3)
    kept = Allocation(placement=(("b", (0, 1)),))
    snapshot = ClusterSnapshot(time_s=0.0, nodes=(NodeInfo("a", 4), NodeInfo("b", 2)), jobs=(job,),
                               current=Plan({"k": kept, "m": Allocation(placement=(("a", (2, 3)),))}))
    view = usable.policy_view(snapshot)
    assert [(n.name, n.gpus) for n in view.nodes] == [("a", 3), ("b", 2)]
    assert view.current.get("m").placement == (("a", (1, 2)),) and view.current.get("k") is kept
    plan = usable.schedule(get_policy("fifo"), dataclasses.replace(snapshot, current=Plan()))
    assert plan.get("j").placement == (("a", (0, 2, 3)),)
    assert usable.to_physical(Plan({"k": kept})).get("k") is kept
    assert UsableGpus([_node("a", 4)]).policy_view(snapshot) is snapshot


def test_inference_tasks_leave_a_faulted_gpu_and_never_go_to_one() -> None:
    live = LiveInference(get_policy("fifo"), clock=lambda: 1000.0)
    nodes = (NodeInfo("i0", 2, pool="inference"),)
    snapshot = ClusterSnapshot(time_s=1000.0, nodes=nodes, jobs=())
    task = common_pb2.Job(id="t1", spec=common_pb2.JobSpec(kind=common_pb2.JOB_KIND_INFERENCE,
                                                           application="infer-resnet50-1", min_gpus=1, max_gpus=1))
    first = live.place(snapshot, Plan(), [task])
    assert first.get("t1").placement == (("i0", (0,)),)
    moved = live.place(snapshot, Plan(), [task], unusable={"i0": frozenset({0})})
    assert moved.get("t1").placement == (("i0", (1,)),)
    other = common_pb2.Job(id="t2", spec=task.spec)
    # GPU 1 serves t1 and GPU 0 is faulted: t2 waits rather than take the faulted GPU.
    assert live.place(snapshot, Plan(), [task, other], unusable={"i0": frozenset({0})}).get("t2") is None
