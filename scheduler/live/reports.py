"""What the agents report about their tasks (ReportTasks): releases proven, GPUs held twice,
progress and metrics forwarded, measurements fed to the estimator, and the job state moves
the ranks' phases imply (running, succeeded, failed, restarted from a checkpoint)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc
from google.protobuf import timestamp_pb2
from prometheus_client import Counter

from scheduler.live import convert, metrics
from scheduler.live.clients import TERMINAL_STATES, Clients
from scheduler.live.feedback import EstimatorFeedback
from scheduler.live.plans import PlanStore
from scheduler.live.jobs import KnownJobs
from scheduler.live.progress import ProgressWriter
from scheduler.live.releases import ReleaseTracker
from scheduler.live.resizes import MAX_CRASH_RESTARTS, RESTART_EXIT_CODES, CrashRestarts
from silod.v1 import allocation_pb2, common_pb2, metadata_pb2, plan_pb2

_log = logging.getLogger("silod.scheduler")

GPU_DOUBLE_HELD = Counter(
    "silod_scheduler_gpu_double_held_total", "Reports of one (node, GPU) held by tasks of two different jobs"
)

Transition = Callable[[str, int, int, str], Awaitable[common_pb2.Job | None]]


class TaskReports:
    def __init__(self, clients: Clients, plans: PlanStore, releases: ReleaseTracker, restarts: CrashRestarts,
                 feedback: EstimatorFeedback, *, transition: Transition, trigger: Callable[[str], None],
                 jobs: KnownJobs, progress: ProgressWriter) -> None:
        self.clients = clients
        self.jobs = jobs  # the job's state without a read per report (scheduler.live.progress)
        self.progress = progress  # progress and metrics, written in batches
        self.plans = plans
        self.releases = releases
        self.restarts = restarts
        self.feedback = feedback
        self._transition = transition
        self._trigger = trigger
        self.tasks: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}  # (job, generation) -> rank -> (phase, exit)

    def forget_finished(self, active: set[str]) -> None:
        """Drop the rank phases of jobs no longer active (a long-lived scheduler sees millions)."""
        for key in [key for key in self.tasks if key[0] not in active]:
            del self.tasks[key]

    async def report(self, request: allocation_pb2.ReportTasksRequest) -> list[str]:
        """Apply one node's report; the exits it acknowledges (``job/rank/generation``)."""
        node = request.node
        if request.applied_plan_version > self.plans.latest_version:
            # The node runs a plan this scheduler has not read (a commit of the leader before a
            # restart, landed after this one's first read): its tasks' generations are that plan's.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.plans.refresh()
        holders: dict[int, str] = {}
        live_held: set[tuple[str, int]] = set()
        for t in request.tasks:
            self.tasks.setdefault((t.job_id, t.generation), {})[t.rank] = (t.phase, t.exit_code)
            if t.phase != allocation_pb2.TASK_PHASE_EXITED:
                for i in t.gpu_indices:
                    live_held.add((t.job_id, i))
                    if i in holders and holders[i] != t.job_id:
                        GPU_DOUBLE_HELD.inc()
                        _log.error("GPU held by two jobs", extra={"node": node, "gpu": i, "jobs": [holders[i], t.job_id]})
                    holders.setdefault(i, t.job_id)
        if self.releases.proven_by_report(node, request.applied_plan_version, live_held):
            self._trigger("release")

        by_job: dict[str, list[allocation_pb2.TaskReport]] = {}
        for t in request.tasks:
            by_job.setdefault(t.job_id, []).append(t)
        applying: dict[str, Awaitable[_Applied]] = {}
        generations: dict[str, int] = {}
        for job_id, mine in by_job.items():
            entry = self.plans.allocation(job_id)
            generations[job_id] = entry.generation if entry is not None else -1
            current = [t for t in mine if t.generation == generations[job_id]]
            if current:
                applying[job_id] = self._apply(job_id, entry, current, node)
        # The node's jobs are independent of one another: applied together, their writes join
        # the same batches, and the report waits for one write rather than one per job.
        applied = dict(zip(applying, await asyncio.gather(*applying.values())))
        if any(outcome.moved for outcome in applied.values()):
            self._trigger("completion")
        # An exit is acknowledged (and so never reported again) once it is taken in: one of a
        # generation no longer placed is of no use, one of the current generation is acknowledged
        # only when its job was read and moved as the exit says. Otherwise the agent repeats it:
        # acknowledged without its move, a finished job would stay RUNNING for good.
        return [f"{t.job_id}/{t.rank}/{t.generation}" for job_id, mine in by_job.items() for t in mine
                if t.phase == allocation_pb2.TASK_PHASE_EXITED
                and (t.generation != generations[job_id] or applied[job_id].settled)]

    async def _apply(self, job_id: str, entry: plan_pb2.JobAllocation, reports: list, node: str) -> _Applied:
        """Apply the reports of the job's current generation."""
        md = self.clients.md
        job = self.jobs.get(job_id)
        if job is None:  # not in the last snapshot (this scheduler just started): read it once
            try:
                job = await md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id))
            except grpc.aio.AioRpcError as exc:
                # NOT_FOUND: deleted, nothing left to move. Else its exits come back next report.
                return _Applied(moved=False, settled=exc.code() == grpc.StatusCode.NOT_FOUND)
            self.jobs.saw(job)
        if job.state in TERMINAL_STATES:
            return _Applied(moved=False, settled=True)
        rank0 = next((t for t in reports if t.rank == 0), None)
        allocated_sent = False
        if rank0 is not None and (rank0.progress.ByteSize() or rank0.step_time_s):
            samples = []
            for name, value in (("step_time_s", rank0.step_time_s),
                                ("samples_per_s", rank0.progress.throughput_samples_per_s)):
                if value > 0:
                    samples.append(common_pb2.MetricSample(job_id=job_id, name=name, value=value, time=_now(),
                                                           labels={"node": node, "rank": "0"}))
            update = metadata_pb2.UpdateJobProgressRequest(
                job_id=job_id, progress=rank0.progress,
                allocated=common_pb2.ResourceVector(gpus=len(convert.ranks_of(entry)))) \
                if rank0.progress.ByteSize() else None
            await self.progress.write(update, samples)
            if update is not None:
                allocated_sent = True
                self.jobs.reported(job_id, rank0.progress)
            self.feedback.observe(job, entry, rank0)
        failed = next((t for t in reports if t.phase == allocation_pb2.TASK_PHASE_EXITED and t.exit_code != 0), None)
        # Killed for passing its memory limit: a restart would pass it again, so the job fails
        # saying so (its owner raises memory_bytes_per_rank or uses less).
        out_of_memory = failed is not None and failed.exit_reason.startswith("out of memory")
        if failed is not None and not out_of_memory and self.restarts.allows(job_id, failed.exit_code):
            count = self.restarts.begin(job_id)
            metrics.restarted_after_crash()
            why = (f"rank {failed.rank} (generation {failed.generation}) on {node} "
                   f"{RESTART_EXIT_CODES[failed.exit_code]} (exit {failed.exit_code}); restarting every rank "
                   f"from the last checkpoint ({count} of {MAX_CRASH_RESTARTS})")
            if job.state == common_pb2.JOB_STATE_RUNNING:
                await self._transition(job_id, job.state, common_pb2.JOB_STATE_RESIZING, why)
            else:  # already RESIZING or SCHEDULED: the move says nothing, an event does
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await md.AppendJobEvent(metadata_pb2.AppendJobEventRequest(job_id=job_id, type="restart",
                                                                               message=why))
            _log.warning("a rank ended for a restart; the job restarts from its checkpoint",
                         extra={"job_id": job_id, "rank": failed.rank, "node": node, "restart": count})
            return _Applied(moved=True, settled=True)
        if failed is not None and job_id in self.restarts.waiting:
            # The other ranks of the killed generation fail as their peer vanished.
            return _Applied(moved=False, settled=True)
        if failed is not None:
            why = f": {failed.exit_reason}" if failed.exit_reason else ""
            return await self._moved(job_id, await self._transition(
                job_id, job.state, common_pb2.JOB_STATE_FAILED,
                f"rank {failed.rank} (generation {failed.generation}) on {node} exited with code "
                f"{failed.exit_code}{why}"))
        world = len(convert.ranks_of(entry))
        seen = self.tasks.get((job_id, entry.generation), {})
        all_up = world > 0 and all(
            r in seen and (seen[r][0] == allocation_pb2.TASK_PHASE_RUNNING
                           or (seen[r][0] == allocation_pb2.TASK_PHASE_EXITED and seen[r][1] == 0))
            for r in range(world))
        all_done = world > 0 and all(seen.get(r, (0, 1)) == (allocation_pb2.TASK_PHASE_EXITED, 0) for r in range(world))
        rank0_done = seen.get(0) == (allocation_pb2.TASK_PHASE_EXITED, 0)
        state = job.state
        if state in (common_pb2.JOB_STATE_SCHEDULED, common_pb2.JOB_STATE_RESIZING) and (all_up or rank0_done):
            updated = await self._transition(job_id, state, common_pb2.JOB_STATE_RUNNING,
                                             f"all {world} ranks of generation {entry.generation} running")
            if updated is None:  # the copy here was stale: the exits wait for the job as it is
                return await self._moved(job_id, None)
            state = updated.state
            if not allocated_sent:  # a command without the SDK reports no progress
                await self.progress.write(metadata_pb2.UpdateJobProgressRequest(
                    job_id=job_id, allocated=common_pb2.ResourceVector(gpus=world)), [])
        if state == common_pb2.JOB_STATE_RUNNING and (all_done or rank0_done):
            return await self._moved(job_id, await self._transition(
                job_id, state, common_pb2.JOB_STATE_SUCCEEDED, f"generation {entry.generation} finished"))
        # Done, but in a state a finish cannot come from (PENDING: the plan's move not made yet):
        # the exits come back until it can.
        return _Applied(moved=False, settled=not (all_done or rank0_done))

    async def _moved(self, job_id: str, updated: common_pb2.Job | None) -> _Applied:
        """The outcome of a move an exit asked for. A refused move (the job was moved elsewhere
        since the copy here: a cancel, another leader's report, an admin) leaves the exits
        unacknowledged, and the job is read afresh, so that the agent's next report is applied
        to it as it is."""
        if updated is not None:
            return _Applied(moved=True, settled=True)
        with contextlib.suppress(grpc.aio.AioRpcError):
            self.jobs.saw(await self.clients.md.GetJob(metadata_pb2.GetJobRequest(job_id=job_id)))
        return _Applied(moved=False, settled=False)


class _Applied(NamedTuple):
    moved: bool  # the job finished, failed or restarts: a round is due
    settled: bool  # its current generation's exits may be acknowledged


def _now() -> timestamp_pb2.Timestamp:
    # Timestamp.GetCurrentTime goes through datetime; at a thousand nodes' reports a second it
    # showed in the scheduler's profile.
    now = time.time_ns()
    return timestamp_pb2.Timestamp(seconds=now // 1_000_000_000, nanos=now % 1_000_000_000)
