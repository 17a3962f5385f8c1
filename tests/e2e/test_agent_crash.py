"""kill -9 of a worker agent mid-run: its task processes die with it (as on a crashed machine,
never orphaned to write the job's checkpoints next to their successors), the scheduler
requeues its jobs once the node's heartbeats stop, and they resume from their last checkpoint
on the other nodes and succeed."""

from __future__ import annotations

import time

from silod.v1 import common_pb2
from tests.e2e.harness import wait_until
from worker_agent.gpus import check_exclusive

NODE_TIMEOUT_S = 4.0
CHECKPOINT_EVERY_S = 1.0
# 4 + 2 + 2 + 2 = 10 GPUs: all run on 12; the 8 left after the crash run them in turn.
# 1,600 samples/s each: 6 s of work for the big ones.
JOBS = [("a", 4, 9600), ("b", 2, 9600), ("c", 2, 8000), ("d", 2, 8000)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_agent_takes_its_tasks_down_and_its_jobs_finish_elsewhere(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster("sqlite", node_timeout_s=NODE_TIMEOUT_S)
    env = {"SILOD_CHECKPOINT_EVERY_S": str(CHECKPOINT_EVERY_S)}
    ids = {name: cluster.submit(name, gpus, gpus, samples=samples, env=env) for name, gpus, samples in JOBS}

    # Crash once every job has checkpointed at least once (a job that already finished wrote its
    # final one), on the node whose running tasks hold the most GPUs.
    wait_until(lambda: all(cluster.checkpoint_history(j) for j in ids.values()), timeout=120,
               what="every job checkpointed")
    tasks = {name: [t for t in agent.tasks() if t.pid and t.state == "running"] for name, agent in cluster.agents.items()}
    victim = max(tasks, key=lambda n: sum(len(t.gpu_indices) for t in tasks[n]))
    victim_tasks = tasks[victim]
    victim_jobs = {t.job_id for t in victim_tasks}
    assert victim_jobs, "the crash hits running jobs"
    killed_at = cluster.kill_agent(victim)

    # The tasks die with their agent, long before the node counts as lost.
    wait_until(lambda: not any(_running(t.pid) for t in victim_tasks), timeout=NODE_TIMEOUT_S,
               what="the killed agent's tasks to die")
    dead_at = time.time()
    victim_generations = {(t.job_id, t.generation) for t in victim_tasks}

    finished = cluster.wait_terminal(list(ids.values()), timeout=240)
    for name, job_id in ids.items():
        assert finished[job_id].state == common_pb2.JOB_STATE_SUCCEEDED, f"{name}: {finished[job_id].message}"
        assert finished[job_id].progress.samples_done == dict((n, s) for n, _, s in JOBS)[name]

    for job_id in victim_jobs:
        resumes = cluster.resumes(job_id)
        after = [r for r in resumes if r[2] > killed_at]
        assert after, f"{job_id} relaunched after the crash"
        generation, resumed_at, relaunched_at = after[0]
        # Requeued once the node's heartbeats had stopped for the node timeout (the last one came
        # up to a heartbeat interval before the kill, later on a loaded machine), and then within
        # a generous bound; by then the old processes were gone: the job never ran twice at once.
        assert NODE_TIMEOUT_S - 2.0 <= relaunched_at - killed_at <= NODE_TIMEOUT_S + 60
        assert relaunched_at > dead_at
        assert generation > max(r[0] for r in resumes if r[2] <= killed_at)
        # Resumed from the last checkpoint its killed processes wrote (the shared checkpoint
        # directory), which nobody overwrote in between: the dead wrote nothing more.
        saves = cluster.checkpoint_history(job_id)
        before = [s for s in saves if s["t"] <= dead_at]
        assert before and (job_id, before[-1]["generation"]) in victim_generations
        assert resumed_at == before[-1]["samples_done"] > 0
        # Which launches died (the agent's stamp: a contained rank's pid is its namespace's).
        victim_launches = {s["launch"] for s in before if (job_id, s["generation"]) in victim_generations}
        assert not [s for s in saves if s["launch"] in victim_launches and s["t"] > dead_at]
    cluster.assert_gpus_never_double_held()  # the surviving agents
    check_exclusive(cluster.killed[victim].gpu_history())
    assert cluster.double_held_total() == 0
