"""Ten jobs of mixed sizes on 3 nodes x 4 GPUs, real processes end to end: all succeed, and no
GPU is ever held by two tasks, by the agents' own records and by the scheduler's metric."""

from __future__ import annotations

import pytest

from silod.v1 import common_pb2

# (name, min_gpus, max_gpus, samples): rigid (min == max) and elastic jobs of 1, 2 and 4 GPUs.
# 32 samples per 0.02 s step: 1,600 samples/s of emulated work, whatever the job's size. They
# need 28 GPUs at their maximum (fifo gives the maximum), so they run in about three waves.
JOBS = [
    ("r1a", 1, 1, 4800), ("r2a", 2, 2, 3200), ("r4a", 4, 4, 4800), ("r1b", 1, 1, 3200), ("r2b", 2, 2, 4800),
    ("r4b", 4, 4, 3200), ("e12", 1, 2, 4800), ("e14a", 1, 4, 3200), ("e24", 2, 4, 4800), ("e14b", 1, 4, 3200),
]


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_ten_mixed_jobs_succeed_and_no_gpu_is_ever_held_twice(make_cluster, db: str) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(db)
    ids = {name: cluster.submit(name, lo, hi, samples=samples) for name, lo, hi, samples in JOBS}
    assert len(set(ids.values())) == len(JOBS)

    finished = cluster.wait_terminal(list(ids.values()), timeout=240)

    for name, job_id in ids.items():
        job = finished[job_id]
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{name}: {common_pb2.JobState.Name(job.state)} {job.message}"
        assert job.progress.samples_done == dict((n, s) for n, _, _, s in JOBS)[name]
    assert sorted(j.id for j in cluster.all_jobs()) == sorted(ids.values())
    cluster.assert_gpus_never_double_held()
    launched_jobs = {job for agent in cluster.agents.values() for job, *_ in agent.launches()}
    assert launched_jobs == set(ids.values())
    assert cluster.double_held_total() == 0
