"""The active jobs as this scheduler knows them: read whole now and then, and in between only the
jobs whose state changed since the last read (ListJobsRequest.state_changed_since), with the
progress the ranks report and the state moves this scheduler makes applied as they happen.

At 5,000 active jobs, listing all of them every round was the biggest part of a round, and of
the metadata service's work; a round changes the state of a few dozen.

* A whole read every ``full_every_s`` (and the first, and after an election) catches anything an
  incremental read could miss; an incremental read asks from the previous read's time less
  ``overlap_s``, for writes stamped before that time that committed after it. The periodic whole
  read runs in the background, beside the rounds (reading 5,000 jobs took a round a third of a
  second), and is merged at the next refresh: what this scheduler learnt of a job while it ran
  (a move, a submission, an incremental read, reported progress) is newer than the whole read
  and wins over it.
* Progress: the scheduler forwards every rank-0 report to the store (scheduler.live.progress)
  and keeps the newest here, so the policy sees it without reading it back. Progress written to
  the store by anything else (an admin's UpdateJobProgress) shows at the next whole read.
* A report about a job not known here (this scheduler just started) reads it with GetJob.
* Jobs submitted and moved through this scheduler are applied here at once, so a write that
  committed later than its time stamp plus ``overlap_s`` (a long batch on a loaded PostgreSQL)
  delays only what others changed directly in the store, until the next whole read.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from google.protobuf import timestamp_pb2

from scheduler.live.clients import ACTIVE_STATES, Clients
from scheduler.policy import ChangedSince
from silod.v1 import common_pb2, metadata_pb2

FULL_EVERY_S = 30.0
OVERLAP_S = 2.0
MAX_IDS_PER_READ = 1000  # ListJobsRequest.job_ids


class KnownJobs:
    def __init__(self, clients: Clients, *, full_every_s: float = FULL_EVERY_S, overlap_s: float = OVERLAP_S) -> None:
        self.clients = clients
        self.full_every_s = full_every_s
        self.overlap_s = overlap_s
        self._active: dict[str, common_pb2.Job] = {}  # in submission order
        self._others: dict[str, common_pb2.Job] = {}  # read for a report, not (yet) among the active
        self._since: timestamp_pb2.Timestamp | None = None  # the next incremental read asks from here
        self._full_at = -float("inf")  # monotonic time of the last whole read's start
        # The periodic whole read in flight, and the jobs this scheduler learnt of meanwhile.
        self._whole: asyncio.Future[tuple[list[common_pb2.Job], timestamp_pb2.Timestamp | None]] | None = None
        self._touched: set[str] = set()
        # The jobs whose entry among the active changed (set, replaced or dropped) since the last
        # refresh returned (a whole read merged counts those it changed); None before the first.
        self._changed: set[str] | None = None
        self._appended: set[str] = set()  # of those, the ones added to the active jobs as new entries (last)
        # What the last refresh returned, for the parts that follow the active jobs by their
        # changes rather than passing over 20,000 each round: the active jobs by id (a copy) and
        # the ids whose entry changed since the refresh before (None: take them all).
        self.last_active: dict[str, common_pb2.Job] = {}
        self.changes: frozenset[str] | None = None
        # Of the changes, those that are new entries of last_active, in its order: they are its
        # last ones (an entry set again keeps its place, a new one goes last). None with changes.
        self.appended: tuple[str, ...] | None = None
        # The same as a hint (scheduler.policy.ChangedSince): last_active against the refresh
        # before's, each changed job's message (None: no longer active), the appended ones last.
        self.changed_since: ChangedSince[common_pb2.Job] | None = None
        self.refreshes = 0  # refreshes returned: a part that missed one cannot follow changes
        self.full_reads = 0
        self.incremental_reads = 0

    def get(self, job_id: str) -> common_pb2.Job | None:
        return self._active.get(job_id) or self._others.get(job_id)

    def saw(self, job: common_pb2.Job) -> None:
        """``job`` as submitted, read or moved here; an older copy (read before a move) is ignored."""
        known = self.get(job.id)
        if known is not None and job.state_version < known.state_version:
            return
        self._touch(job.id)
        if job.state in ACTIVE_STATES:
            self._others.pop(job.id, None)
            self._set_active(job)  # a new one last: submissions come in order
        else:
            self._active.pop(job.id, None)
            self._others[job.id] = job

    def moved(self, brief: common_pb2.Job, before: common_pb2.Job) -> None:
        """A move made here, as TransitionJobs answers with state_only (state, version, message,
        time stamps): spec and progress are those known here, or ``before``'s (the copy the move
        was made from) if the job is no longer known."""
        job = common_pb2.Job()
        job.CopyFrom(self.get(brief.id) or before)
        job.state, job.state_version, job.message = brief.state, brief.state_version, brief.message
        for name in ("updated_at", "started_at", "finished_at"):
            if brief.HasField(name):
                getattr(job, name).CopyFrom(getattr(brief, name))
            else:
                job.ClearField(name)
        self.saw(job)

    def forget(self, job_id: str) -> None:
        """Moved by someone else: read afresh when next needed. An active job needs nothing: its
        move came after the read that gave the copy here, so the next read brings it."""
        self._others.pop(job_id, None)

    def reported(self, job_id: str, progress: common_pb2.JobProgress) -> None:
        """Rank 0's progress, as forwarded to the store."""
        known = self._active.get(job_id)
        if known is not None:
            self._touch(job_id)
            job = common_pb2.Job()  # a new message: a round in flight may be reading the old one
            job.CopyFrom(known)
            job.progress.CopyFrom(progress)
            self._active[job_id] = job

    def reset(self) -> None:
        """The next read is whole (a newly elected leader starts from the store's view)."""
        self._since = None
        self._drop_whole()

    async def refresh(self) -> list[common_pb2.Job]:
        """The active jobs now, in submission order; :attr:`last_active` and :attr:`changes` say
        the same, and what changed since the last refresh."""
        await self._refresh()
        before, self.last_active = self.last_active, dict(self._active)
        self.changes = frozenset(self._changed) if self._changed is not None else None
        self.appended = self._new_last() if self.changes is not None else None
        if self.appended is None:
            self.changes = self.changed_since = None
        else:
            appended = set(self.appended)
            entries = {job_id: self.last_active.get(job_id) for job_id in self.changes if job_id not in appended}
            entries.update((job_id, self.last_active[job_id]) for job_id in self.appended)
            self.changed_since = ChangedSince(before, self.last_active, entries)
        self._changed, self._appended = set(), set()
        self.refreshes += 1
        return list(self.last_active.values())

    def _new_last(self) -> tuple[str, ...] | None:
        """The entries new among the active jobs since the last refresh, as last_active's last
        ones; None if they are not (then nothing is followed: a whole pass is always right)."""
        new = {job_id for job_id in self._appended if job_id in self.last_active}
        last = tuple(itertools.islice(reversed(self.last_active), len(new)))[::-1]
        return last if new == set(last) else None

    async def _refresh(self) -> None:
        if self._since is None:  # the first read, after an election, or no read times: whole, now
            self._drop_whole()
            started = time.monotonic()
            jobs, read_at = await self._read(metadata_pb2.ListJobsRequest(states=ACTIVE_STATES))
            self._merge_whole(jobs, touched=set())
            self._full_at = started
            self._advance(read_at)
            return
        if self._whole is not None and self._whole.done():
            whole, self._whole = self._whole, None
            if whole.exception() is None:  # a failed one is tried again when next due
                jobs, read_at = whole.result()
                self._merge_whole(jobs, touched=self._touched)
                if read_at is not None and self._since is not None:
                    self._since = min(self._since, _less(read_at, self.overlap_s), key=lambda t: t.ToNanoseconds())
        if self._whole is None and time.monotonic() - self._full_at >= self.full_every_s:
            self._full_at = time.monotonic()
            self._touched = set()
            self._whole = asyncio.ensure_future(self._read(metadata_pb2.ListJobsRequest(states=ACTIVE_STATES)))
        assert self._since is not None
        jobs, read_at = await self._changed_since(self._since)
        for job in jobs:
            known = self._active.get(job.id)
            if known is not None and known.state_version > job.state_version:
                continue  # this scheduler moved it since
            self._touch(job.id)
            if job.state in ACTIVE_STATES:
                if known is not None and known.state_version == job.state_version:
                    job.progress.CopyFrom(known.progress)  # the reported progress is as new
                self._set_active(job)
            else:
                self._active.pop(job.id, None)
        self.incremental_reads += 1
        self._advance(read_at)

    async def _changed_since(self, since: timestamp_pb2.Timestamp
                             ) -> tuple[list[common_pb2.Job], timestamp_pb2.Timestamp | None]:
        """The jobs whose state changed since ``since`` that this scheduler does not already
        hold at that state: which moved is read in the state view (id, state, version), and only
        those it lacks are read whole. Most moves are this scheduler's own (a round places
        thousands, the reports start and end them): reading those back whole made a round's
        snapshot wait a tenth to half a second at 5,000 jobs."""
        moved, read_at = await self._read(metadata_pb2.ListJobsRequest(
            state_changed_since=since, view=metadata_pb2.JOB_VIEW_STATE))
        jobs: list[common_pb2.Job] = []
        lacking: list[str] = []
        for job in moved:
            if job.HasField("spec"):  # a metadata service without views sends the whole job
                jobs.append(job)
                continue
            known = self._active.get(job.id)
            if known is not None and known.state_version >= job.state_version:
                continue  # held here as it is, or newer (moved by this scheduler since)
            if job.state in ACTIVE_STATES:
                lacking.append(job.id)
            else:
                jobs.append(job)  # ended: its state is all it takes to drop it
        for first in range(0, len(lacking), MAX_IDS_PER_READ):
            whole, _ = await self._read(metadata_pb2.ListJobsRequest(job_ids=lacking[first:first + MAX_IDS_PER_READ]))
            jobs.extend(whole)
        return jobs, read_at

    def _merge_whole(self, jobs: list[common_pb2.Job], touched: set[str]) -> None:
        """A whole read: every active job as of its start. A job this scheduler learnt of since
        (``touched``) is as it knows it, active or ended; one it knows that the read lacks and it
        did not touch ended or went away before the read.

        The jobs known here keep their order and, where the read has them as they are known
        (same version, equal message), their message: what changed is then known by identity,
        and followers take a whole read like any other refresh, not as 20,000 changes. The jobs
        new to this scheduler go last, in the read's order."""
        read = {job.id: job for job in jobs}
        before = self._active
        fresh: dict[str, common_pb2.Job] = {}
        for job_id, known in before.items():
            if job_id in touched:  # submitted, moved or reported while the read ran
                fresh[job_id] = known
                continue
            job = read.get(job_id)
            if job is None:
                continue  # ended or went away before the read
            if known.state_version > job.state_version or (known.state_version == job.state_version and known == job):
                fresh[job_id] = known
            else:
                fresh[job_id] = job
        for job_id, job in read.items():
            if job_id not in fresh and job_id not in touched and job_id not in before:
                fresh[job_id] = job
                self._appended.add(job_id)
        if self._changed is not None:
            self._changed.update(job_id for job_id, job in fresh.items() if before.get(job_id) is not job)
            self._changed.update(job_id for job_id in before if job_id not in fresh)
        else:
            # The first read: nothing follows the order yet, and the jobs known before it were
            # learnt from reports, in the order their nodes reported. The read's order is the
            # submission order, which the active jobs keep.
            fresh = {**{job.id: fresh[job.id] for job in jobs if job.id in fresh}, **fresh}
        self._active = fresh
        self._others.clear()
        self.full_reads += 1

    def _advance(self, read_at: timestamp_pb2.Timestamp | None) -> None:
        if read_at is None:  # a metadata service that keeps no state change times: whole reads only
            self._since = None
        else:
            self._since = _less(read_at, self.overlap_s)

    def _set_active(self, job: common_pb2.Job) -> None:
        if job.id not in self._active:
            self._appended.add(job.id)
        self._active[job.id] = job

    def _touch(self, job_id: str) -> None:
        """Called before every change of ``job_id``'s entry among the active jobs."""
        if self._whole is not None:
            self._touched.add(job_id)
        if self._changed is not None:
            self._changed.add(job_id)

    def _drop_whole(self) -> None:
        if self._whole is not None:
            self._whole.cancel()
            self._whole = None

    async def _read(self, request: metadata_pb2.ListJobsRequest
                    ) -> tuple[list[common_pb2.Job], timestamp_pb2.Timestamp | None]:
        """Every page; the read time of the first (None from a service that does not say)."""
        jobs: list[common_pb2.Job] = []
        read_at = None
        request.page_size = 1000
        while True:
            page = await self.clients.md.ListJobs(request)
            if read_at is None and page.HasField("read_at"):
                read_at = page.read_at
            jobs.extend(page.jobs)
            if not page.next_page_token:
                return jobs, read_at
            request.page_token = page.next_page_token


def _less(time_stamp: timestamp_pb2.Timestamp, seconds: float) -> timestamp_pb2.Timestamp:
    earlier = timestamp_pb2.Timestamp()
    earlier.FromNanoseconds(time_stamp.ToNanoseconds() - int(seconds * 1e9))
    return earlier
