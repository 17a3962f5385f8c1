"""JobInfos follows KnownJobs' changes (scheduler.live.job_infos): a round that matches only the
jobs that changed gives the same JobInfos, in the same order, as a pass over every job, and the
snapshot's ``jobs_changed`` names exactly the infos that are not last round's objects."""

from __future__ import annotations

import asyncio
import random

from scheduler.live.job_infos import JobInfos
from scheduler.policy import ClusterSnapshot
from silod.v1 import common_pb2
from tests.scheduler_live.test_snapshot_incremental import PENDING, RUNNING, SUCCEEDED, Rounds, _cluster

INFERENCE = common_pb2.JOB_KIND_INFERENCE


async def _whole_pass(rounds: Rounds) -> tuple:
    """The infos a JobInfos that never saw a round makes of the jobs the core last refreshed."""
    core = rounds.core
    known = core.jobs
    infos = JobInfos(core.models)
    jobs = list(known.last_active.values())
    matched = infos.match(jobs, known)
    assert infos.last_match == "whole"
    datasets = await core.models.datasets_of([job for job, _ in matched.fresh_training])
    made, hint = infos.update(matched, datasets, core.snapshots._nodes.gpu_types, {})
    assert hint is None, "a first round has nothing to follow"
    return made


def _check_hint(before: ClusterSnapshot, after: ClusterSnapshot) -> None:
    hint = after.jobs_changed
    assert hint is not None and hint.follows(before.jobs, after.jobs)
    old = {info.job_id: info for info in before.jobs}
    new = {info.job_id: info for info in after.jobs}
    for job_id in old.keys() | new.keys():
        if job_id in hint.entries:
            assert hint.entries[job_id] is new.get(job_id), job_id
        else:
            assert old.get(job_id) is new.get(job_id), f"{job_id} changed, and the hint does not say so"


def test_following_the_changes_gives_what_a_pass_over_every_job_gives() -> None:
    async def scenario() -> None:
        rng = random.Random(45)
        store = _cluster()
        rounds = Rounds(store)
        core = rounds.core
        last = await rounds.snapshot()
        followed = 0
        serial = 0
        for step in range(80):
            active = [job_id for job_id, (job, _) in store.jobs.items() if job.state in (PENDING, RUNNING)]
            for _ in range(rng.randint(0, 4)):
                action = rng.random()
                job_id = rng.choice(active) if active else None
                if action < 0.25 or job_id is None:
                    serial += 1
                    if rng.random() < 0.15:
                        store.add_job(f"serve-{serial}", application="", kind=INFERENCE, max_gpus=1)
                    else:
                        store.add_job(f"new-{serial}", state=rng.choice((PENDING, RUNNING)),
                                      min_gpus=1, max_gpus=rng.randint(1, 4), dataset=rng.choice(("", "ds")))
                elif action < 0.4:
                    store.move(job_id, SUCCEEDED)
                    active.remove(job_id)
                elif action < 0.55 and store.jobs[job_id][0].state == PENDING:
                    store.move(job_id, RUNNING)
                elif action < 0.75 and not job_id.startswith("serve"):
                    progress = common_pb2.JobProgress(samples_done=rng.randint(1, 10_000))
                    store.edit(job_id, lambda job: job.progress.CopyFrom(progress))
                    core.jobs.reported(job_id, progress)
                elif action < 0.85 and not job_id.startswith("serve"):
                    edited = store.edit(job_id, lambda job: setattr(job.spec, "batch_size", rng.choice((64, 128, 256))))
                    core.jobs.saw(edited)
                elif action < 0.9:
                    # Seen ended, then active again (a stale read, then a newer one): its entry
                    # goes last among KnownJobs' active jobs, and so among the infos.
                    job = core.jobs.get(job_id)
                    if job is not None:
                        ended = common_pb2.Job()
                        ended.CopyFrom(job)
                        ended.state, ended.state_version = SUCCEEDED, job.state_version + 1
                        core.jobs.saw(ended)
                        again = common_pb2.Job()
                        again.CopyFrom(job)
                        again.state_version = job.state_version + 2
                        core.jobs.saw(again)
                elif action < 0.93:
                    core.jobs.reset()  # a whole read, as every 30 s
            store.now += 10
            snap, _ = await core.snapshot()
            followed += core.snapshots._job_infos.last_match == "changes"
            assert snap.jobs == await _whole_pass(rounds), f"step {step}"
            _check_hint(last, snap)
            last = snap
        assert followed > 60, f"only {followed} of 80 rounds followed the changes"

    asyncio.run(scenario())


def test_a_round_that_fails_after_matching_makes_the_next_one_pass_over_every_job() -> None:
    async def scenario() -> None:
        store = _cluster()
        rounds = Rounds(store)
        core = rounds.core
        await rounds.snapshot()
        infos = core.snapshots._job_infos
        store.add_job("lost-in-a-failed-round")
        store.now += 10
        jobs = await core.jobs.refresh()
        infos.match(jobs, core.jobs)  # ... and the round fails before update
        assert infos.last_match == "changes"
        store.add_job("after")
        snap = await rounds.snapshot()
        assert infos.last_match == "whole"
        assert {"lost-in-a-failed-round", "after"} <= {info.job_id for info in snap.jobs}

    asyncio.run(scenario())


def test_inference_jobs_and_the_split_the_planner_takes() -> None:
    async def scenario() -> None:
        store = _cluster()
        store.add_job("serve", application="", kind=INFERENCE, max_gpus=1)
        rounds = Rounds(store)
        await rounds.snapshot()
        builder = rounds.core.snapshots
        assert [job.id for job in builder.inference_jobs] == ["serve"]
        assert set(builder.training_ids) == {f"job-{i}" for i in range(6)}
        store.move("serve", SUCCEEDED)
        store.add_job("serve-2", application="", kind=INFERENCE, max_gpus=1)
        await rounds.snapshot()
        assert builder._job_infos.last_match == "changes"
        assert [job.id for job in builder.inference_jobs] == ["serve-2"]

    asyncio.run(scenario())

