"""Carrying out a plan: commit it to the metadata store (a new version, or none when nothing
changed; a new leader's first plan always, so that the nodes learn its epoch), record the GPUs it takes from jobs as pending release, move the jobs' states, log it.

Cost: one CommitPlanChanges (the entries that changed since the plan in force, the same
mechanism as the simulator's, scheduler.plan_changes), and one TransitionJobs call per MAX_MOVES
jobs whose state the plan changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import grpc

from scheduler.live import convert
from services.runtime.batching import Coalescer
from scheduler.live.clients import PLACED_STATES, Clients
from scheduler.live.entries import EntryChanges
from scheduler.live.gpu_health import Placement
from scheduler.live.jobs import KnownJobs
from scheduler.live.plans import PlanStore
from scheduler.live.releases import ReleaseTracker
from scheduler.live.resizes import CrashRestarts
from scheduler.plan_changes import PlanChanges, changes_between
from silod.v1 import common_pb2, metadata_pb2, plan_pb2

_log = logging.getLogger("silod.scheduler")

MAX_MOVES = 1000  # state moves per TransitionJobs call (the metadata service's limit)


class Committer:
    def __init__(self, clients: Clients, plans: PlanStore, releases: ReleaseTracker, restarts: CrashRestarts,
                 trigger: Callable[[str], None], jobs: KnownJobs) -> None:
        self.clients = clients
        self.jobs = jobs  # told of every move made here, so reports need not read the job
        self.plans = plans
        self.releases = releases
        self.restarts = restarts
        self._trigger = trigger
        self.last_outcome = "unchanged"  # of the last commit: committed, unchanged or lost_race (scheduler metrics)
        self._entries: tuple[int, dict[str, bytes]] = (-1, {})  # (version, job -> its entry serialized)
        self._changes_supported = True  # False once the metadata service answered UNIMPLEMENTED
        self._moves: Coalescer[metadata_pb2.TransitionJobRequest, metadata_pb2.TransitionResult] = \
            Coalescer(self._send_moves, max_items=MAX_MOVES)
        # The jobs whose state may disagree with the plan, gathered from KnownJobs' changes since the
        # last state pass (None: pass over every job: the first, after a whole read of the jobs, a
        # refresh not seen here, or a pass that failed), and the refresh they were gathered up to.
        self._unmatched: set[str] | None = None
        self._refresh_seen = -1
        self.last_looked: int | None = None  # jobs the last state pass looked at (None: every job; tests)

    async def commit(self, proto: plan_pb2.AllocationPlan, base: plan_pb2.AllocationPlan | None,
                     jobs: Mapping[str, common_pb2.Job], reason: str, *,
                     placements: Mapping[str, Placement] | None = None,
                     changes: EntryChanges | None = None,
                     ) -> plan_pb2.AllocationPlan | None:
        """Commit ``proto``, built on ``base`` (the plan in force), and carry it out; None when it
        changes nothing or another commit won the race (a retry round is triggered).
        ``placements``: each job's placement in ``proto``, where the caller has them;
        ``changes``: what ``proto`` changes of ``base``, where the caller knows it (the planner
        does, scheduler.live.entries), else it is found by comparing every entry."""
        latest = base
        self.last_outcome = "unchanged"
        self._gather_job_changes()
        entries: dict[str, bytes] | None = None
        if latest is None:
            changes = None
        elif changes is None:
            entries = {entry.job_id: entry.SerializeToString(deterministic=True) for entry in proto.jobs}
            found = changes_between(self._entries_of(latest), entries)
            changes = EntryChanges(
                upserts={e.job_id: e for e in proto.jobs if e.job_id in found.upserts}, removals=found.removals,
                previous={e.job_id: e for e in latest.jobs if e.job_id in found.upserts or e.job_id in found.removals})
        if changes is not None and not changes and latest is not None and latest.epoch == proto.epoch:
            return None  # nothing changed: no new version (a new leader's first plan is committed anyway:
            # every node then learns its epoch at once and refuses the deposed leader's plans)
        try:
            committed = await self._send(proto, changes.as_plan_changes() if changes is not None else None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                _log.warning("plan commit lost a race; retrying next round", extra={"version": proto.version})
                self.last_outcome = "lost_race"
                await self.plans.refresh()
                self._trigger("retry")
                return None
            raise
        # The committed plan's entries are the proto's (kept serialized only where they were
        # serialized to find the changes).
        self._entries = (committed.version, entries) if entries is not None else (-1, {})
        # Its placements, worked out once (by the planner, for its own proto) rather than by the
        # release record below and again when it becomes the plan in force.
        own = committed is proto
        if not own:  # a store that answered the whole plan: its entries are other objects
            changes = None
        # A plan built in place from the one in force is read by its changes from now on (releases,
        # metrics, the snapshot's holdings, the feed): only the changed entries' are kept.
        convert.remember_placements(committed, placements if own else None,
                                    only=changes.upserts.values() if changes is not None and changes.in_place else None)
        # GPUs taken from a job are pending release until the node acknowledges them.
        if latest is not None:
            self.releases.record(latest, committed, changes)
        await self.plans.set_latest(committed, base=latest, changes=changes)
        self.restarts.placed(committed)
        unmatched, self._unmatched = self._unmatched, None  # a pass that fails leaves the next one whole
        await self._transitions(committed, latest, jobs, placements if own else None, changes, unmatched)
        self._unmatched = set()
        _log_commit(committed, latest, reason, placements if own else None, changes)
        self.last_outcome = "committed"
        return committed

    def _entries_of(self, plan: plan_pb2.AllocationPlan) -> dict[str, bytes]:
        """Each job's entry of ``plan``, serialized (kept from the last commit: the base of the next)."""
        if self._entries[0] != plan.version:
            self._entries = (plan.version, {e.job_id: e.SerializeToString(deterministic=True) for e in plan.jobs})
        return self._entries[1]

    async def _send(self, proto: plan_pb2.AllocationPlan,
                    changes: PlanChanges[plan_pb2.JobAllocation] | None) -> plan_pb2.AllocationPlan:
        """Commit ``proto`` as its changes of the plan in force when there is one (the whole plan to a
        metadata service without CommitPlanChanges); the whole plan committed."""
        md = self.clients.md
        if changes is None or not self._changes_supported:
            return await md.CommitPlan(metadata_pb2.CommitPlanRequest(plan=proto))
        header = plan_pb2.AllocationPlan()
        header.CopyFrom(proto)
        del header.jobs[:]
        # The upserts are proto's own entries (EntryChanges): no lookup by job over all of them.
        request = metadata_pb2.CommitPlanChangesRequest(plan=header, header_only=True, changes=plan_pb2.PlanChanges(
            base_version=proto.version - 1, jobs=list(changes.upserts.values()),
            removed_job_ids=list(changes.removals)))
        try:
            reply = await md.CommitPlanChanges(request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._changes_supported = False  # an older metadata service: whole plans from now on
            return await md.CommitPlan(metadata_pb2.CommitPlanRequest(plan=proto))
        if reply.jobs or reply.version != proto.version:
            return reply  # a metadata service that answers the whole plan whatever it is asked
        # The committed plan is the one sent, its header as stored (created_at to the microsecond).
        # Its entries are in this scheduler's order, the store's may differ: nothing reads an
        # entry by position. Keeping these objects keeps what was worked out about them (their
        # placements, convert.remember_placements) for the rounds this plan is in force.
        proto.created_at.CopyFrom(reply.created_at)
        return proto

    def _gather_job_changes(self) -> None:
        """Take in KnownJobs' changes of the round's refresh, for the next state pass."""
        refreshes, changes = self.jobs.refreshes, self.jobs.changes
        if refreshes == self._refresh_seen:
            return
        if self._unmatched is not None and changes is not None and refreshes == self._refresh_seen + 1:
            self._unmatched |= changes
        else:
            self._unmatched = None
        self._refresh_seen = refreshes

    async def _transitions(self, plan: plan_pb2.AllocationPlan, base: plan_pb2.AllocationPlan | None,
                           jobs: Mapping[str, common_pb2.Job], placements: Mapping[str, Placement] | None,
                           changes: EntryChanges | None, unmatched: set[str] | None = None) -> None:
        """Move each job whose state disagrees with ``plan``. Only a job whose entry the plan changed,
        or whose state changed since the last pass (``unmatched``), can: those are looked at where
        both are known, else every job."""
        # Each job moves independently (a compare-and-set of its own); they go out in one
        # TransitionJobs call per MAX_MOVES, since per-call overhead dominated a big round.
        looked: Mapping[str, common_pb2.Job] = jobs
        self.last_looked = None
        if placements is not None and changes is not None and unmatched is not None:
            looked = {job_id: jobs[job_id] for job_id in sorted(unmatched.union(changes.upserts)) if job_id in jobs}
            self.last_looked = len(looked)
        if placements is None or changes is None:
            placements = {entry.job_id: convert.placement_of(entry) for entry in plan.jobs}
            old = {a.job_id: a for a in (base.jobs if base is not None else [])}
            resized = {e.job_id for e in plan.jobs if e.job_id in old and e.generation != old[e.job_id].generation}
        else:  # only an entry the plan changed can have a new generation
            resized = {job_id for job_id, e in changes.upserts.items()
                       if job_id in changes.previous and e.generation != changes.previous[job_id].generation}
        generations = _Generations(plan, changes)
        moves: list[metadata_pb2.TransitionJobRequest] = []
        pending, running = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
        # A pass over the jobs that reads no entry: a job's state against whether the plan places it.
        for job_id, job in looked.items():
            placement = placements.get(job_id)
            if placement is None:
                continue  # not in the plan
            state = job.state
            if placement and state == pending:
                moves.append(_move(job, common_pb2.JOB_STATE_SCHEDULED,
                                   f"placed by plan {plan.version} (generation {generations[job_id]})"))
            elif placement and state == running and job_id in resized:
                moves.append(_move(job, common_pb2.JOB_STATE_RESIZING,
                                   f"resized by plan {plan.version} (generation {generations[job_id]})"))
            elif not placement and state in PLACED_STATES:
                moves.append(_move(job, common_pb2.JOB_STATE_PENDING, f"preempted by plan {plan.version}; requeued"))
        # The batches at once: the metadata service parses one while it writes another, and this
        # process takes in one reply while the next is being built (a round that places 3,200 jobs
        # spent half a second on four batches one after the other). Each job is in one batch, and
        # every batch locks its rows in job id order, so they cannot deadlock on PostgreSQL.
        batches = [moves[start:start + MAX_MOVES] for start in range(0, len(moves), MAX_MOVES)]
        replies = await asyncio.gather(*(
            self.clients.md.TransitionJobs(metadata_pb2.TransitionJobsRequest(transitions=batch, state_only=True))
            for batch in batches))
        for batch, reply in zip(batches, replies):
            for move, result in zip(batch, reply.results):
                if result.error_code:  # moved meanwhile (a report, a cancel): the next round sees it
                    _log.info("transition skipped", extra={"job_id": move.job_id, "reason": result.error})
                    self.jobs.forget(move.job_id)
                else:
                    self.jobs.moved(result.job, jobs[move.job_id])

    async def transition(self, job_id: str, expected: int, new: int, message: str) -> common_pb2.Job | None:
        # Moves of many reports at once go out together, one TransitionJobs call (one commit).
        result = await self._moves.submit(metadata_pb2.TransitionJobRequest(
            job_id=job_id, expected_state=expected, new_state=new, message=message))
        if result.error_code:
            if result.error_code in ("FAILED_PRECONDITION", "NOT_FOUND"):
                _log.info("transition skipped", extra={"job_id": job_id, "reason": result.error})
            else:
                _log.warning("transition refused", extra={"job_id": job_id, "reason": result.error})
            self.jobs.forget(job_id)  # moved by someone else: read afresh when next needed
            return None
        self.jobs.saw(result.job)
        return result.job

    async def _send_moves(self, moves: Sequence[metadata_pb2.TransitionJobRequest]) -> list[metadata_pb2.TransitionResult]:
        reply = await self.clients.md.TransitionJobs(metadata_pb2.TransitionJobsRequest(transitions=moves))
        return list(reply.results)


def _log_commit(plan: plan_pb2.AllocationPlan, base: plan_pb2.AllocationPlan | None, reason: str,
                placements: Mapping[str, Placement] | None, changes: EntryChanges | None) -> None:
    """One line per plan: what an operator asks first when a job moved (which plan, why)."""
    if not _log.isEnabledFor(logging.INFO):
        return
    if placements is None or changes is None:
        placements = {entry.job_id: convert.placement_of(entry) for entry in plan.jobs}
        old = {a.job_id: a for a in (base.jobs if base is not None else [])}
        upserts = {e.job_id: e for e in plan.jobs if e.job_id not in old or e != old[e.job_id]}
    else:
        old, upserts = changes.previous, changes.upserts
    # Counts over every job (cheap: placements at hand), names of the changed ones only.
    placed = [p for p in placements.values() if p]
    changed = [job_id for job_id, e in upserts.items() if placements.get(job_id)
               and (job_id not in old or e.generation != old[job_id].generation)]
    stopped = sum(1 for job_id in upserts if not placements.get(job_id) and job_id in old
                  and convert.placement_of(old[job_id]))
    _log.info("plan committed", extra={
        "version": plan.version, "reason": reason, "jobs_placed": len(placed),
        "gpus": sum(len(idx) for p in placed for _, idx in p), "jobs_started_or_resized": len(changed),
        "jobs_stopped": stopped, "changed": changed[:20]})


class _Generations:
    """Each job's generation in ``plan``, for the messages of its moves: a changed entry's at
    hand, the others' read off the plan once, when a move needs one (rare: a job placed by an
    entry the plan did not change had a move refused before)."""

    def __init__(self, plan: plan_pb2.AllocationPlan, changes: EntryChanges | None) -> None:
        self._plan = plan
        self._changed = changes.upserts if changes is not None else {}
        self._all: dict[str, int] | None = None

    def __getitem__(self, job_id: str) -> int:
        entry = self._changed.get(job_id)
        if entry is not None:
            return entry.generation
        if self._all is None:
            self._all = {e.job_id: e.generation for e in self._plan.jobs}
        return self._all.get(job_id, 0)


def _move(job: common_pb2.Job, new_state: int, message: str) -> metadata_pb2.TransitionJobRequest:
    return metadata_pb2.TransitionJobRequest(job_id=job.id, expected_state=job.state, new_state=new_state, message=message)
