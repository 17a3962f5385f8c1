"""The scheduler's view of the active jobs (scheduler.live.jobs): one whole read, then only the jobs
whose state changed; its own moves and the reported progress applied in between; a whole read
again every full_every_s, after an election, or from a metadata service that gives no read time."""

from __future__ import annotations

import asyncio
import random
import types

from google.protobuf import timestamp_pb2
from prometheus_client import REGISTRY

from scheduler.live import jobs as jobs_module
from scheduler.live import metrics
from scheduler.live.clients import ACTIVE_STATES, Clients
from scheduler.live.jobs import KnownJobs
from silod.v1 import common_pb2, metadata_pb2

PENDING, SCHEDULED, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_RUNNING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED


class FakeMetadata:
    """Jobs with the time of their last state change, on a clock the test moves."""

    def __init__(self, read_time: bool = True, views: bool = True) -> None:
        self.now = 1000
        self.jobs: dict[str, tuple[common_pb2.Job, int]] = {}
        self.requests: list[metadata_pb2.ListJobsRequest] = []
        self.read_time = read_time
        self.views = views  # False: an older service, which ignores view and job_ids

    def put(self, job_id: str, state: int, version: int, samples: int = 0) -> None:
        self.now += 1
        self.jobs[job_id] = (common_pb2.Job(id=job_id, state=state, state_version=version,
                                            spec=common_pb2.JobSpec(application="resnet18"),
                                            progress=common_pb2.JobProgress(samples_done=samples)), self.now)

    async def ListJobs(self, request):  # noqa: N802
        self.requests.append(metadata_pb2.ListJobsRequest.FromString(request.SerializeToString()))
        since = request.state_changed_since.seconds if request.HasField("state_changed_since") else None
        jobs = [job for job, at in self.jobs.values()
                if (not request.states or job.state in request.states) and (since is None or at >= since)
                and (not self.views or not request.job_ids or job.id in request.job_ids)]
        if self.views and request.view == metadata_pb2.JOB_VIEW_STATE:
            jobs = [common_pb2.Job(id=j.id, state=j.state, state_version=j.state_version) for j in jobs]
        reply = metadata_pb2.ListJobsResponse(jobs=jobs)
        if self.read_time:
            reply.read_at.CopyFrom(timestamp_pb2.Timestamp(seconds=self.now))
        return reply


def _ids(jobs: list[common_pb2.Job]) -> list[str]:
    return [j.id for j in jobs]


def test_whole_read_then_changes_only() -> None:
    async def scenario() -> None:
        md = FakeMetadata()
        for i in range(5):
            md.put(f"job-{i}", RUNNING if i < 3 else PENDING, 3)
        known = KnownJobs(Clients(md=md), full_every_s=3600, overlap_s=0)
        assert _ids(await known.refresh()) == [f"job-{i}" for i in range(5)]
        assert list(md.requests[-1].states) == list(ACTIVE_STATES)  # whole: every active job
        md.put("job-0", SUCCEEDED, 4)  # ends
        md.put("job-3", SCHEDULED, 4)  # placed
        md.put("job-5", PENDING, 1)  # submitted
        jobs = await known.refresh()
        # What moved, in the state view; then, whole, only the active jobs not held at that state.
        changed, lacking = md.requests[-2:]
        assert changed.HasField("state_changed_since") and not changed.states
        assert changed.view == metadata_pb2.JOB_VIEW_STATE
        assert sorted(lacking.job_ids) == ["job-3", "job-5"] and not lacking.HasField("state_changed_since")
        assert _ids(jobs) == ["job-1", "job-2", "job-3", "job-4", "job-5"]
        assert known.get("job-3").state == SCHEDULED and known.get("job-5").spec.application == "resnet18"
        assert known.full_reads == 1 and known.incremental_reads == 1

        # Moves this scheduler made and progress reported are kept over older copies read later.
        known.saw(common_pb2.Job(id="job-4", state=SCHEDULED, state_version=4))
        known.reported("job-1", common_pb2.JobProgress(samples_done=640))
        md.put("job-4", PENDING, 3)  # an older copy, as a read racing the move would give it
        md.now += 1
        await known.refresh()
        assert known.get("job-4").state == SCHEDULED and known.get("job-1").progress.samples_done == 640
        known.saw(common_pb2.Job(id="job-1", state=SUCCEEDED, state_version=4))  # a move to an end
        assert "job-1" not in _ids(await known.refresh()) and known.get("job-1").state == SUCCEEDED

        # A submission through this scheduler is active at once, whatever the store's read shows yet.
        known.saw(common_pb2.Job(id="job-9", state=PENDING, state_version=1))
        assert _ids(await known.refresh())[-1] == "job-9"

        known.reset()  # elected: whole again
        await known.refresh()
        assert known.full_reads == 2 and list(md.requests[-1].states) == list(ACTIVE_STATES)

    asyncio.run(scenario())


def test_jobs_learnt_from_reports_before_the_first_read_take_the_submission_order() -> None:
    # A restarted scheduler reads the jobs its nodes report on before its first round's read.
    async def scenario() -> None:
        md = FakeMetadata()
        for i in range(4):
            md.put(f"job-{i}", RUNNING, 3)
        known = KnownJobs(Clients(md=md), full_every_s=3600, overlap_s=0)
        for job_id in ("job-2", "job-0"):  # as GetJob gave them to the reports
            known.saw(md.jobs[job_id][0])
        reported = known.get("job-2")
        assert _ids(await known.refresh()) == ["job-0", "job-1", "job-2", "job-3"]
        assert known.get("job-2") is reported  # the same copy, in its place

    asyncio.run(scenario())


def test_whole_reads_every_interval_and_from_a_service_without_read_times() -> None:
    async def scenario() -> None:
        md = FakeMetadata(read_time=False)
        md.put("job-0", PENDING, 1)
        known = KnownJobs(Clients(md=md), full_every_s=3600)
        for _ in range(3):
            await known.refresh()
        assert known.full_reads == 3 and known.incremental_reads == 0
        md = FakeMetadata()
        md.put("job-0", PENDING, 1)
        known = KnownJobs(Clients(md=md), full_every_s=0.0)
        for _ in range(3):
            await known.refresh()
            await asyncio.sleep(0)  # a round's time: a read in the background goes on
        # The first whole read is the refresh itself; the periodic ones run beside the refreshes
        # and are merged at the next one, which reads the changes as usual.
        assert known.full_reads == 2 and known.incremental_reads == 2

    asyncio.run(scenario())


def test_a_whole_read_in_the_background_yields_to_what_was_learnt_while_it_ran() -> None:
    async def scenario() -> None:
        md = FakeMetadata()
        md.put("job-a", RUNNING, 3)
        md.put("job-b", PENDING, 1)
        md.put("job-c", RUNNING, 3)
        known = KnownJobs(Clients(md=md), full_every_s=0.0, overlap_s=0)
        await known.refresh()  # the first whole read, in the refresh
        release = asyncio.Event()
        whole_reads = md.ListJobs

        async def slow_whole(request):  # noqa: N802 - the store's answer as of the call, delivered later
            reply = await whole_reads(request)
            if request.states:
                await release.wait()
            return reply

        md.ListJobs = slow_whole  # type: ignore[method-assign]
        await known.refresh()  # starts the periodic whole read; reads the changes meanwhile
        assert known.full_reads == 1 and [list(r.states) for r in md.requests[-2:]] == [list(ACTIVE_STATES), []]
        known.saw(common_pb2.Job(id="job-b", state=SCHEDULED, state_version=2))  # placed by this scheduler
        md.put("job-c", SUCCEEDED, 4)  # ended
        md.put("job-d", PENDING, 1)  # submitted elsewhere
        assert _ids(await known.refresh()) == ["job-a", "job-b", "job-d"]
        release.set()
        await asyncio.sleep(0)
        jobs = await known.refresh()  # merges the whole read: its older copies lose
        assert known.full_reads == 2
        assert _ids(jobs) == ["job-a", "job-b", "job-d"] and known.get("job-b").state == SCHEDULED

    asyncio.run(scenario())


def test_jobs_held_at_their_state_are_not_read_again() -> None:
    """A round's own moves (thousands of placements) are already held here: the incremental read
    learns that from the state view and reads nothing whole."""
    async def scenario() -> None:
        md = FakeMetadata()
        for i in range(3):
            md.put(f"job-{i}", PENDING, 1)
        known = KnownJobs(Clients(md=md), full_every_s=3600, overlap_s=0)
        await known.refresh()
        for i in range(3):  # placed by this scheduler: its move and the store agree
            known.saw(common_pb2.Job(id=f"job-{i}", state=SCHEDULED, state_version=2,
                                     spec=common_pb2.JobSpec(application="resnet18")))
            md.put(f"job-{i}", SCHEDULED, 2)
        reads = len(md.requests)
        jobs = await known.refresh()
        assert len(md.requests) == reads + 1 and md.requests[-1].view == metadata_pb2.JOB_VIEW_STATE
        assert [j.state for j in jobs] == [SCHEDULED] * 3 and all(j.spec.application for j in jobs)
        md.put("job-1", SUCCEEDED, 3)  # ended elsewhere: the state view says enough
        reads = len(md.requests)
        assert _ids(await known.refresh()) == ["job-0", "job-2"] and len(md.requests) == reads + 1

    asyncio.run(scenario())


def test_a_service_without_views_is_read_as_before() -> None:
    async def scenario() -> None:
        md = FakeMetadata(views=False)  # sends whole jobs whatever the view asked
        md.put("job-0", PENDING, 1)
        known = KnownJobs(Clients(md=md), full_every_s=3600, overlap_s=0)
        await known.refresh()
        md.put("job-1", PENDING, 1)
        md.put("job-0", SCHEDULED, 2)
        reads = len(md.requests)
        jobs = await known.refresh()
        assert len(md.requests) == reads + 1  # the whole jobs came with the first answer
        assert _ids(jobs) == ["job-0", "job-1"] and known.get("job-0").state == SCHEDULED
        assert known.get("job-1").spec.application == "resnet18"

    asyncio.run(scenario())


def test_a_move_answered_state_only_keeps_the_spec_and_the_newest_progress_known_here() -> None:
    known = KnownJobs(Clients(md=FakeMetadata()))
    before = common_pb2.Job(id="job-1", state=PENDING, state_version=1, spec=common_pb2.JobSpec(application="bert"),
                            progress=common_pb2.JobProgress(samples_done=10))
    known.saw(before)
    known.reported("job-1", common_pb2.JobProgress(samples_done=20))  # after the round's copy was taken
    brief = common_pb2.Job(id="job-1", state=SCHEDULED, state_version=2, message="placed by plan 3")
    brief.updated_at.FromSeconds(50)
    known.moved(brief, before)
    job = known.get("job-1")
    assert (job.state, job.state_version, job.message, job.updated_at.seconds) == (SCHEDULED, 2, "placed by plan 3", 50)
    assert job.spec.application == "bert" and job.progress.samples_done == 20
    # A job no longer known here (dropped meanwhile) is rebuilt from the copy the move was made from.
    other = common_pb2.Job(id="job-2", state=PENDING, state_version=4, spec=common_pb2.JobSpec(application="ncf"))
    known.moved(common_pb2.Job(id="job-2", state=SCHEDULED, state_version=5), other)
    assert known.get("job-2").spec.application == "ncf" and known.get("job-2").state == SCHEDULED
    # An answer older than what is known (a later move already seen) changes nothing.
    known.moved(common_pb2.Job(id="job-1", state=PENDING, state_version=1), before)
    assert known.get("job-1").state == SCHEDULED


def test_changes_name_every_job_whose_entry_changed_since_the_last_refresh(monkeypatch) -> None:
    """A part that follows the active jobs by ``changes`` alone (the job gauges) holds what a
    pass over every job would, through random moves, reports, submissions, store changes and
    periodic whole reads (which say what they changed too; ``changes`` is None after the first
    read only), in the same order and by identity."""
    def gauges() -> dict[str, float]:
        return {f"{s.name}/{s.labels.get('state')}/{s.labels.get('tenant')}": s.value for m in REGISTRY.collect()
                if m.name in ("silod_scheduler_jobs", "silod_scheduler_oldest_pending_job_age_seconds")
                for s in m.samples}

    async def scenario() -> None:
        rng = random.Random(45)
        md = FakeMetadata()
        def put(job_id: str, state: int, version: int) -> None:  # with a submission time, for the oldest pending
            md.put(job_id, state, version)
            md.jobs[job_id][0].created_at.FromSeconds(1000 + int(job_id.split("-")[1]))

        for i in range(20):
            put(f"job-{i}", rng.choice((PENDING, RUNNING)), 1)
        # The periodic whole reads on a clock the test moves: how busy the machine is must not
        # decide how many refreshes merge one.
        clock = [0.0]
        monkeypatch.setattr(jobs_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
        known = KnownJobs(Clients(md=md), full_every_s=30, overlap_s=0)
        mirror: dict[str, common_pb2.Job] = {}
        followed = merged = 0
        for step in range(300):
            action = rng.random()
            job_id = f"job-{rng.randrange(30)}"
            held = known.get(job_id)
            version = (held.state_version if held is not None else 1) + 1
            if action < 0.25:
                known.saw(common_pb2.Job(id=job_id, state=rng.choice((SCHEDULED, RUNNING, SUCCEEDED)),
                                         state_version=version))
            elif action < 0.45:
                known.reported(job_id, common_pb2.JobProgress(samples_done=rng.randrange(10_000)))
            elif action < 0.7:
                put(job_id, rng.choice((PENDING, RUNNING, SUCCEEDED)), version)
            elif action < 0.75:
                md.now += 1
            else:
                before, reads = known.last_active, known.full_reads
                jobs = await known.refresh()
                assert known.last_active == {j.id: j for j in jobs}
                if known.changes is None:
                    assert known.changed_since is None
                    mirror = dict(known.last_active)
                else:
                    followed += 1
                    merged += known.full_reads > reads
                    hint = known.changed_since
                    assert hint is not None and hint.follows(before, known.last_active)
                    assert hint.entries.keys() == known.changes
                    assert tuple(hint.entries)[len(hint.entries) - len(known.appended):] == known.appended
                    for changed, job in hint.entries.items():
                        if job is not None:
                            mirror[changed] = job
                        else:
                            mirror.pop(changed, None)
                    for new in known.appended:  # new entries go last, in order
                        mirror[new] = mirror.pop(new)
                # The same messages in the same order, not only equal ones: a part may follow by identity.
                assert list(mirror) == list(known.last_active), f"step {step}"
                assert all(mirror[j] is known.last_active[j] for j in mirror), f"step {step}"
                metrics.jobs_seen(jobs, 2000.0, changes=known.changes, active=known.last_active,
                                  refresh=known.refreshes)
                followed_gauges = gauges()
                metrics.jobs_seen(jobs, 2000.0)  # the whole pass, for comparison
                assert followed_gauges == gauges(), f"step {step}"
                # and on, following again from here (the whole pass took this refresh in as well)
                metrics._counts.refresh = known.refreshes
            if rng.random() < 0.05:
                clock[0] += 30  # a whole read is due: it starts at the next refresh, merged at one after
            await asyncio.sleep(0)
        assert followed > 20  # most refreshes were followed by their changes
        assert merged >= 2, "whole reads merged were followed by their changes too"

    asyncio.run(scenario())
