"""The state moves after a commit (scheduler.live.commit) look only at the jobs whose entry the plan
changed and those whose state changed since the last pass, and still leave every active job's
state agreeing with the plan: placed jobs scheduled (or running), the others pending, also when
something else moves a placed job back to pending or cancels one."""

from __future__ import annotations

import random

from silod.v1 import common_pb2, metadata_pb2, scheduler_pb2

PENDING, SCHEDULED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED
ACTIVE = (PENDING, SCHEDULED, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_RESIZING)


def test_state_moves_follow_the_changes_and_agree_with_the_plan(cluster) -> None:
    rng = random.Random(45)
    for k in range(4):
        cluster.add_node(f"n{k}", gpus=4)
    def submit(name: str) -> None:
        gpus = rng.choice((1, 2, 4))
        cluster.submit(name, min_gpus=gpus, max_gpus=gpus)

    for i in range(12):
        submit(f"j{i}")
    cluster.round()
    followed = 0
    for step in range(25):
        for k in range(4):
            cluster.heartbeat(f"n{k}")
        jobs = {j.id: j for j in cluster.md.ListJobs(metadata_pb2.ListJobsRequest(states=ACTIVE)).jobs}
        placed = [job_id for job_id, job in jobs.items() if job.state == SCHEDULED]
        roll = rng.random()
        if roll < 0.4 and placed:  # something else puts a placed job back in the queue
            cluster.md.TransitionJob(metadata_pb2.TransitionJobRequest(
                job_id=rng.choice(placed), expected_state=SCHEDULED, new_state=PENDING, message="test requeue"))
        elif roll < 0.7 and placed:  # a running job cancelled: a waiting one takes its GPUs
            cluster.jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=rng.choice(placed)))
        # A new job every step: every round has a change to commit (an unchanged plan is not
        # committed, and its state pass waits for the next one that is).
        submit(f"k{step}")
        plan = cluster.round()
        for k in range(4):  # the nodes run nothing: every GPU taken from a job is released at once
            cluster.report(f"n{k}", plan.version)
        followed += cluster.core.committer.last_looked is not None
        placements = {entry.job_id: bool(entry.placements) for entry in plan.jobs}
        for job in cluster.md.ListJobs(metadata_pb2.ListJobsRequest(states=ACTIVE)).jobs:
            if job.id in placements:
                assert (job.state != PENDING) == placements[job.id], (step, job.id, job.state)
    assert followed >= 15, followed
