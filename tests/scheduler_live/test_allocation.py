"""Rounds, AllocationService.Watch/Ack/ReportTasks, release-before-reuse, node loss."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from scheduler.live import convert
from silod.v1 import allocation_pb2, common_pb2, plan_pb2
from tests.scheduler_live.harness import wait_for

RUNNING = allocation_pb2.TASK_PHASE_RUNNING
EXITED = allocation_pb2.TASK_PHASE_EXITED
WORKER = allocation_pb2.PLAN_COMPONENT_WORKER_AGENT


def _entry(plan: plan_pb2.AllocationPlan, job_id: str) -> plan_pb2.JobAllocation:
    return next(j for j in plan.jobs if j.job_id == job_id)


def _gpus(plan: plan_pb2.AllocationPlan, job_id: str) -> set[tuple[str, int]]:
    return {(p.node, i) for p in _entry(plan, job_id).placements for i in p.gpu_indices}


class Watcher:
    def __init__(self, cluster, node: str, known_version: int = 0) -> None:
        self.plans: queue.Queue[plan_pb2.NodePlan] = queue.Queue()
        self.call = cluster.alloc.Watch(allocation_pb2.WatchPlanRequest(node=node, component=WORKER,
                                                                         known_version=known_version))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for plan in self.call:
                self.plans.put(plan)
        except grpc.RpcError:
            pass

    def next(self, timeout: float = 10.0) -> plan_pb2.NodePlan:
        return self.plans.get(timeout=timeout)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def test_round_places_jobs_and_watch_streams_latest_then_newer(cluster) -> None:
    cluster.add_node("n1", gpus=2)
    cluster.add_node("n2", gpus=2)
    a = cluster.submit("a", min_gpus=3, max_gpus=3)
    plan = cluster.round()
    assert plan is not None and plan.version == 1 and len(_gpus(plan, a.id)) == 3
    assert cluster.state(a.id) == common_pb2.JOB_STATE_SCHEDULED
    assert _entry(plan, a.id).generation == 1

    watcher, other = Watcher(cluster, "n1"), Watcher(cluster, "n2")
    first = watcher.next()
    assert other.next().version == 1  # a watcher's first plan, always
    assert first.version == 1
    ranks = sorted(t.rank for t in first.tasks)
    n2_ranks = 3 - len(ranks)
    assert all(t.world_size == 3 and t.generation == 1 and t.spec.name == "a" for t in first.tasks)
    assert {t.master_addr for t in first.tasks} == {"n1.local"} and len({t.master_port for t in first.tasks}) == 1
    assert 29500 <= first.tasks[0].master_port < 30500 and ranks == list(range(len(ranks))) and n2_ranks >= 1

    b = cluster.submit("b", min_gpus=1, max_gpus=1)
    newer = cluster.round()
    assert newer.version == 2 and len(_gpus(newer, b.id)) == 1
    # Only the node whose part changed (b's) is sent plan 2; the other's part is what it has.
    (b_node, _), = _gpus(newer, b.id)
    changed, unchanged = (watcher, other) if b_node == "n1" else (other, watcher)
    second = changed.next()
    assert second.version == 2 and b.id in {t.job_id for t in second.tasks}
    with pytest.raises(queue.Empty):
        unchanged.next(timeout=1.5)
    watcher.close()
    other.close()

    # A reconnecting watcher starts from the latest plan, whatever it says it knows, changed or not.
    again = Watcher(cluster, "n1" if b_node == "n2" else "n2", known_version=1)
    assert again.next().version == 2
    again.close()
    assert cluster.round().version == 2  # nothing changed: no new version


def test_report_tasks_drive_running_then_succeeded(cluster_any_db) -> None:
    cluster = cluster_any_db
    cluster.add_node("n1", gpus=2)
    job = cluster.submit("r", min_gpus=2, max_gpus=2)
    plan = cluster.round()
    gen = _entry(plan, job.id).generation
    ack = cluster.alloc.Ack(allocation_pb2.AckPlanRequest(node="n1", component=WORKER, version=plan.version, ok=True))
    assert ack.latest_version == plan.version
    cluster.report(plan.version and "n1", plan.version,
                   allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=RUNNING, gpu_indices=[0]))
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SCHEDULED  # rank 1 not running yet
    progress = common_pb2.JobProgress(samples_done=640, steps_done=5, throughput_samples_per_s=100.0)
    cluster.report("n1", plan.version,
                   allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=RUNNING, gpu_indices=[0],
                                             progress=progress, step_time_s=1.28, batch_size=128),
                   allocation_pb2.TaskReport(job_id=job.id, rank=1, generation=gen, phase=RUNNING, gpu_indices=[1]))
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING
    from silod.v1 import metadata_pb2
    stored = cluster.md.GetJob(metadata_pb2.GetJobRequest(job_id=job.id))
    assert stored.progress.samples_done == 640
    names = {s.name for s in cluster.md.QueryMetrics(metadata_pb2.QueryMetricsRequest(job_id=job.id)).samples}
    assert {"step_time_s", "samples_per_s"} <= names
    # Exits of a stale generation are ignored but acknowledged.
    stale = cluster.report("n1", plan.version, allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen - 1,
                                                                        phase=EXITED, exit_code=1))
    assert list(stale.acknowledged_exits) == [f"{job.id}/0/{gen - 1}"]
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING
    done = cluster.report("n1", plan.version,
                          allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=EXITED, exit_code=0),
                          allocation_pb2.TaskReport(job_id=job.id, rank=1, generation=gen, phase=EXITED, exit_code=0))
    assert set(done.acknowledged_exits) == {f"{job.id}/0/{gen}", f"{job.id}/1/{gen}"}
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SUCCEEDED
    # The ranks' phases are kept while the job is active, and forgotten by the round after its end.
    assert (job.id, gen) in cluster.core.reports.tasks
    cluster.round()
    assert not [key for key in list(cluster.core.reports.tasks) if key[0] == job.id]


def test_an_exit_whose_move_is_refused_is_repeated_until_the_job_finishes(cluster) -> None:
    # The job moved in the store behind this scheduler's copy (another leader's report, an admin):
    # the finish the exit asks for is refused against the stale copy. Acknowledged anyway, the
    # agent would never repeat it and the job would stay RUNNING for good.
    from silod.v1 import metadata_pb2
    job, plan, gen = _one_job_placed(cluster, "s")
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SCHEDULED
    cluster.md.TransitionJob(metadata_pb2.TransitionJobRequest(
        job_id=job.id, expected_state=common_pb2.JOB_STATE_SCHEDULED, new_state=common_pb2.JOB_STATE_RUNNING,
        message="moved elsewhere"))
    exit_ = allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=EXITED, exit_code=0)
    first = cluster.report("n1", plan.version, exit_)
    assert list(first.acknowledged_exits) == []
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING
    again = cluster.report("n1", plan.version, exit_)
    assert list(again.acknowledged_exits) == [f"{job.id}/0/{gen}"]
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SUCCEEDED


def test_a_report_from_a_plan_newer_than_the_schedulers_reads_that_plan_first(cluster) -> None:
    # A restarted scheduler read the plan in force just before the killed one's last commit
    # landed: nodes run that newer plan, and their exits are of its generations, not stale ones.
    from silod.v1 import metadata_pb2
    job, plan, _ = _one_job_placed(cluster, "g")
    newer = plan_pb2.AllocationPlan()
    newer.CopyFrom(plan)
    newer.version = plan.version + 1
    entry = _entry(newer, job.id)
    entry.generation += 1
    committed = cluster.md.CommitPlan(metadata_pb2.CommitPlanRequest(plan=newer))
    assert committed.version == newer.version
    done = cluster.report("n1", newer.version, allocation_pb2.TaskReport(
        job_id=job.id, rank=0, generation=entry.generation, phase=EXITED, exit_code=0))
    assert list(done.acknowledged_exits) == [f"{job.id}/0/{entry.generation}"]
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SUCCEEDED


def test_an_exit_is_repeated_while_the_metadata_service_cannot_say_what_the_job_is(cluster) -> None:
    # A report about a job this scheduler does not know reads it; that read failing must not
    # acknowledge the exit it came with.
    job, plan, gen = _one_job_placed(cluster, "u")
    exit_ = allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=EXITED, exit_code=0)
    known = cluster.core.jobs
    unknown = cluster.scheduler.submit(_forget_and_break_reads(known, cluster.core.clients, job.id))
    try:
        assert list(cluster.report("n1", plan.version, exit_).acknowledged_exits) == []
    finally:
        cluster.scheduler.submit(unknown())
    assert list(cluster.report("n1", plan.version, exit_).acknowledged_exits) == [f"{job.id}/0/{gen}"]
    assert cluster.state(job.id) == common_pb2.JOB_STATE_SUCCEEDED


def _one_job_placed(cluster, name: str) -> tuple[common_pb2.Job, plan_pb2.AllocationPlan, int]:
    """A job placed on n1's one GPU by a round: the job, the plan and its generation there."""
    cluster.add_node("n1", gpus=1)
    job = cluster.submit(name)
    plan = cluster.round()
    return job, plan, _entry(plan, job.id).generation


async def _forget_and_break_reads(known, clients, job_id: str):
    """The scheduler's known jobs lack ``job_id`` (as after a restart) and GetJob fails
    UNAVAILABLE; the function returned puts both back."""
    known.get = lambda wanted: None if wanted == job_id else type(known).get(known, wanted)
    real = clients.md

    class Unavailable(grpc.aio.AioRpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down for a test")

    class Breaking:
        def __getattr__(self, name: str):
            return getattr(real, name)

        async def GetJob(self, request, **kwargs):  # noqa: N802
            raise Unavailable()

    clients.md = Breaking()

    async def restore() -> None:
        clients.md = real
        del known.get
    return restore


def test_nonzero_exit_fails_the_job(cluster) -> None:
    cluster.add_node("n1", gpus=1)
    job = cluster.submit("f")
    plan = cluster.round()
    gen = _entry(plan, job.id).generation
    cluster.report("n1", plan.version, allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=EXITED,
                                                                exit_code=3))
    from silod.v1 import metadata_pb2
    failed = cluster.md.GetJob(metadata_pb2.GetJobRequest(job_id=job.id))
    assert failed.state == common_pb2.JOB_STATE_FAILED and "code 3" in failed.message


def test_a_rank_killed_for_its_memory_limit_fails_the_job_saying_so(cluster) -> None:
    # SIGKILL (137) would restart the job from its checkpoint; killed for passing its memory
    # limit, a restart would pass it again: the job fails, and its message says why.
    from silod.v1 import metadata_pb2

    cluster.add_node("n1", gpus=1)
    job = cluster.submit("oom")
    plan = cluster.round()
    gen = _entry(plan, job.id).generation
    reason = "out of memory: the rank passed its limit of 256 MiB"
    cluster.report("n1", plan.version, allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=EXITED,
                                                                exit_code=137, exit_reason=reason))
    failed = cluster.md.GetJob(metadata_pb2.GetJobRequest(job_id=job.id))
    assert failed.state == common_pb2.JOB_STATE_FAILED
    assert failed.message.endswith(f"exited with code 137: {reason}"), failed.message


def test_released_gpu_not_reused_before_ack(cluster) -> None:
    cluster.add_node("n1", gpus=1)
    a = cluster.submit("a")
    b = cluster.submit("b")
    plan = cluster.round()
    assert _gpus(plan, a.id) == {("n1", 0)} and not _gpus(plan, b.id)
    cluster.jobs.CancelJob(__import__("silod.v1.scheduler_pb2", fromlist=["x"]).CancelJobRequest(job_id=a.id))
    released = wait_for(lambda: (p := cluster.latest()).version > plan.version and p, what="plan after cancel")
    assert not _gpus(released, b.id), "GPU handed to b before a's release was acknowledged"
    cluster.round()
    assert not _gpus(cluster.latest(), b.id)
    # The agent still reports a's task on GPU 0: not released.
    cluster.report("n1", released.version, allocation_pb2.TaskReport(job_id=a.id, rank=0, generation=1,
                                                                    phase=RUNNING, gpu_indices=[0]))
    cluster.round()
    assert not _gpus(cluster.latest(), b.id)
    cluster.alloc.Ack(allocation_pb2.AckPlanRequest(node="n1", component=WORKER, version=released.version, ok=True,
                                                    released_jobs=[a.id]))
    wait_for(lambda: _gpus(cluster.latest(), b.id) == {("n1", 0)}, what="b placed after the release ack")


def test_release_proven_by_report_without_the_task(cluster) -> None:
    cluster.add_node("n1", gpus=1)
    a = cluster.submit("a")
    b = cluster.submit("b")
    plan = cluster.round()
    from silod.v1 import scheduler_pb2
    cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.id))
    released = wait_for(lambda: (p := cluster.latest()).version > plan.version and p, what="plan after cancel")
    cluster.report("n1", released.version, allocation_pb2.TaskReport(job_id=a.id, rank=0, generation=1,
                                                                    phase=EXITED, exit_code=143))
    wait_for(lambda: _gpus(cluster.latest(), b.id) == {("n1", 0)}, what="b placed after a's task exited")
    assert cluster.state(a.id) == common_pb2.JOB_STATE_CANCELLED


def test_node_timeout_requeues_jobs(make_cluster) -> None:
    cluster = make_cluster(node_timeout_s=2.0)
    cluster.add_node("n1", gpus=1)
    cluster.add_node("n2", gpus=1)
    a = cluster.submit("a", min_gpus=2, max_gpus=2)
    plan = cluster.round()
    assert len(_gpus(plan, a.id)) == 2 and cluster.state(a.id) == common_pb2.JOB_STATE_SCHEDULED
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        cluster.heartbeat("n1")  # n2 goes silent
        time.sleep(0.2)
    lost = cluster.round("node-lost")
    assert lost is not None and not _gpus(lost, a.id)
    assert cluster.state(a.id) == common_pb2.JOB_STATE_PENDING


def test_gpu_held_by_two_jobs_is_counted(cluster) -> None:
    from scheduler.live.reports import GPU_DOUBLE_HELD

    cluster.add_node("n1", gpus=2)
    before = GPU_DOUBLE_HELD._value.get()
    cluster.report("n1", 0,
                   allocation_pb2.TaskReport(job_id="job-aaaaaaaaaaaa", rank=0, generation=1, phase=RUNNING, gpu_indices=[1]),
                   allocation_pb2.TaskReport(job_id="job-bbbbbbbbbbbb", rank=0, generation=1, phase=RUNNING, gpu_indices=[1]))
    assert GPU_DOUBLE_HELD._value.get() == before + 1


def test_bad_allocation_requests_name_the_field(cluster) -> None:
    from tests.metadata.metadata_harness import assert_rpc_error

    bad = grpc.StatusCode.INVALID_ARGUMENT
    assert_rpc_error(lambda: cluster.alloc.Ack(allocation_pb2.AckPlanRequest(version=1)), bad, "node")
    assert_rpc_error(lambda: cluster.report("", 0), bad, "node")
    assert_rpc_error(lambda: cluster.report("n1", 0, allocation_pb2.TaskReport(rank=0)), bad, "tasks[0].job_id")
    assert_rpc_error(lambda: next(iter(cluster.alloc.Watch(allocation_pb2.WatchPlanRequest(), timeout=5))), bad, "node")


def test_node_arrival_triggers_a_round_without_waiting_for_the_interval(cluster) -> None:
    job = cluster.submit("waiting")  # no nodes yet: stays pending
    cluster.add_node("late", gpus=1)
    # Well under the 60 s interval; the first round also fits the job's profile (seconds of CPU
    # on a loaded 2-core machine: 10 s was exceeded once at load 7).
    wait_for(lambda: cluster.state(job.id) == common_pb2.JOB_STATE_SCHEDULED, timeout=30, what="round on node arrival")


def test_round_with_estimator_models(make_cluster) -> None:
    from estimator.service import Settings as EstimatorSettings
    from estimator.service import definition as estimator_definition
    from tests.support.inprocess import InProcessServer

    settings = EstimatorSettings()
    with InProcessServer(estimator_definition(settings), settings, thread_name="estimator") as estimator:
        cluster = make_cluster(estimator_address=estimator.address)
        cluster.add_node("n1", gpus=2)
        job = cluster.submit("e", min_gpus=1, max_gpus=2)
        plan = cluster.round()
        assert plan is not None and 1 <= len(_gpus(plan, job.id)) <= 2
        cluster.close()


def test_unacked_release_survives_a_scheduler_restart(cluster) -> None:
    from silod.v1 import scheduler_pb2

    cluster.add_node("n1", gpus=1)
    a = cluster.submit("a")
    plan = cluster.round()
    cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.id))
    released = wait_for(lambda: (p := cluster.latest()).version > plan.version and p, what="plan after cancel")
    cluster.restart_scheduler()
    b = cluster.submit("b")
    cluster.round()
    assert not _gpus(cluster.latest(), b.id), "restarted scheduler reused a GPU whose release was never acked"
    cluster.alloc.Ack(allocation_pb2.AckPlanRequest(node="n1", component=WORKER, version=released.version, ok=True,
                                                    released_jobs=[a.id]))
    wait_for(lambda: _gpus(cluster.latest(), b.id) == {("n1", 0)}, what="b placed after the ack")


def test_losing_a_node_resizes_a_running_elastic_job(make_cluster) -> None:
    # n1 keeps heartbeating from a thread for the whole test, with a wide margin over its
    # timeout, so a loaded machine cannot make n1 look lost too; only n2 goes silent.
    # Both nodes heartbeat until the job runs on both: the first round (profile fitting) can
    # take longer than the 2 s timeout on a loaded machine.
    cluster = make_cluster(node_timeout_s=2.0)
    cluster.add_node("n1", gpus=1)
    cluster.add_node("n2", gpus=1)
    stop, n2_stop = threading.Event(), threading.Event()

    def keep_alive(node: str, until: threading.Event) -> None:
        while not until.wait(0.2):
            cluster.heartbeat(node)

    beaters = [threading.Thread(target=keep_alive, args=("n1", stop), daemon=True),
               threading.Thread(target=keep_alive, args=("n2", n2_stop), daemon=True)]
    for beater in beaters:
        beater.start()
    try:
        job = cluster.submit("elastic", min_gpus=1, max_gpus=2)
        plan = cluster.round()
        gen = _entry(plan, job.id).generation
        assert len(_gpus(plan, job.id)) == 2
        cluster.report("n1", plan.version, allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=RUNNING,
                                                                    gpu_indices=[0]))
        cluster.report("n2", plan.version, allocation_pb2.TaskReport(job_id=job.id, rank=1, generation=gen, phase=RUNNING,
                                                                    gpu_indices=[0]))
        assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING
        n2_stop.set()  # only n2 goes silent
        resized = wait_for(
            lambda: (p := cluster.latest()).version > plan.version and _gpus(p, job.id) == {("n1", 0)} and p,
            what="plan with the job on n1 only",
        )
    finally:
        stop.set()
        n2_stop.set()
        for beater in beaters:
            beater.join(5)
    assert _gpus(resized, job.id) == {("n1", 0)}
    new_gen = _entry(resized, job.id).generation
    assert new_gen == gen + 1
    # The plan is visible in metadata as soon as it is committed; the scheduler moves the job's
    # state just after, in its own call, so a fast reader can still see RUNNING for a moment.
    wait_for(lambda: cluster.state(job.id) == common_pb2.JOB_STATE_RESIZING, timeout=10, what="job RESIZING")
    cluster.report("n1", resized.version,
                   allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=gen, phase=EXITED, exit_code=143),
                   allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=new_gen, phase=RUNNING, gpu_indices=[0]))
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING  # the stale generation's exit is ignored


def test_every_committed_plan_is_logged_with_its_reason_and_changes(cluster, caplog) -> None:
    cluster.add_node("n1", gpus=2)
    job = cluster.submit("logged", min_gpus=1, max_gpus=1)
    with caplog.at_level("INFO", logger="silod.scheduler"):
        plan = cluster.round("operator asked")
    records = [r for r in caplog.records if r.getMessage() == "plan committed" and r.version == plan.version]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    line = records[0]
    assert line.jobs_placed == 1 and line.gpus == 1 and line.changed == [job.id] and line.jobs_stopped == 0
    assert line.reason in ("operator asked", "arrival")  # a submission may trigger the round first


def test_a_node_part_is_the_same_whatever_the_version_and_differs_with_any_other_field() -> None:
    def part(version: int, epoch: int = 3, gpu: int = 0, quota: int = 0) -> plan_pb2.NodePlan:
        view = plan_pb2.NodePlan(version=version, node="n1", epoch=epoch)
        view.tasks.add(job_id="job-a", rank=0, world_size=1, gpu_indices=[gpu], generation=2)
        if quota:
            view.cache_quotas.add(job_id="job-a", cache_quota_bytes=quota)
        return view

    assert convert.same_node_part(part(4), part(9))
    assert not convert.same_node_part(part(4), part(9, epoch=4))  # a new leader's plans reach every node
    assert not convert.same_node_part(part(4), part(9, gpu=1))
    assert not convert.same_node_part(part(4), part(9, quota=2**30))
    assert not convert.same_node_part(part(4), plan_pb2.NodePlan(version=9, node="n1", epoch=3))
