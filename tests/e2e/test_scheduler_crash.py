"""kill -9 of the scheduler mid-run, then a restart on the same metadata database: no job lost or
duplicated, running tasks keep running (same generation, same process), everything succeeds."""

from __future__ import annotations

from silod.v1 import common_pb2
from tests.e2e.harness import wait_until

# 2 + 2 + 4 + 2 + 2 + 4 = 16 GPUs on 12: some run, some wait across the crash. ~6 s of work each.
JOBS = [("a", 2, 9600), ("b", 2, 9600), ("c", 4, 9600), ("d", 2, 6400), ("e", 2, 6400), ("f", 4, 6400)]


# SQLite only: the PostgreSQL path of the same processes is covered end to end by
# test_mixed_jobs, and its kill -9 durability by tests/metadata; each case here costs ~40 s.
def test_scheduler_kill_9_and_restart_loses_nothing_and_keeps_tasks_running(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster("sqlite")
    ids = {name: cluster.submit(name, gpus, gpus, samples=samples, env={"SILOD_CHECKPOINT_EVERY_S": "1"})
           for name, gpus, samples in JOBS}

    def running_tasks() -> dict[tuple[str, int, int], int]:
        return {(t.job_id, t.rank, t.generation): t.pid for agent in cluster.agents.values()
                for t in agent.tasks() if t.state == "running" and t.pid}

    # Crash once the first jobs' ranks all run and report progress, and others still wait.
    def mid_run() -> dict[tuple[str, int, int], int] | None:
        jobs = {j.id: j for j in cluster.all_jobs()}
        running = [j for j in jobs.values() if j.state == common_pb2.JOB_STATE_RUNNING and j.progress.samples_done > 0]
        return running_tasks() if len(running) >= 2 else None

    before = wait_until(mid_run, timeout=120, what="jobs running")
    states_before = {j.id: j.state for j in cluster.all_jobs()}
    assert common_pb2.JOB_STATE_PENDING in states_before.values(), "some jobs still wait when the scheduler dies"
    cluster.scheduler.kill()
    cluster.start_scheduler()

    # Clients retrying their submissions after the crash get the same jobs back.
    assert {name: cluster.submit(name, gpus, gpus, samples=samples, env={"SILOD_CHECKPOINT_EVERY_S": "1"})
            for name, gpus, samples in JOBS} == ids
    finished = cluster.wait_terminal(list(ids.values()), timeout=240)
    assert sorted(j.id for j in cluster.all_jobs()) == sorted(ids.values())
    for name, job_id in ids.items():
        assert finished[job_id].state == common_pb2.JOB_STATE_SUCCEEDED, f"{name}: {finished[job_id].message}"

    # Every task running at the crash ran to its end in the same process: launched once (GPU
    # table and logs), and every checkpoint of its generation, the final one included, was written
    # by that one launch.
    launches = [launch for agent in cluster.agents.values() for launch in agent.launches()]
    for job_id, rank, generation in before:
        assert [(j, r) for j, r, g, _ in launches if j == job_id and r == rank] == [(job_id, rank)], \
            f"{job_id} rank {rank} relaunched"
        if rank == 0:
            history = cluster.checkpoint_history(job_id)
            final = history[-1]
            assert final["generation"] == generation
            assert {s["launch"] for s in history if s["generation"] == generation} == {final["launch"]}
            assert final["samples_done"] == finished[job_id].progress.samples_done
    cluster.assert_gpus_never_double_held()
    assert cluster.double_held_total() == 0  # the restarted scheduler's count
