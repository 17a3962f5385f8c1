"""The live scheduler, assembled: the parts of scheduler/live/ wired together, and the one
round they make (snapshot -> plan -> commit). docs/architecture.md ("Inside the live
scheduler") maps which part answers what.

Cost of a round: one ListJobs of the jobs whose state changed (scheduler.live.jobs), one ListNodes, one GetDataset per dataset
new to the scheduler, one GetJobModel per job whose fitted model is older than
ESTIMATE_TTL_S (the estimator's answers to our own Observe calls refresh it in between), one
CommitPlan and one TransitionJob per job whose state the plan changes, sent concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable

import grpc

from estimator.job_model import JobModel
from scheduler.deepboot.replicas import LifecycleConfig, ProtectSchedule
from scheduler.live import metrics
from scheduler.live.clients import Clients
from scheduler.live.commit import Committer
from scheduler.live.data import CachedBytesProbe
from scheduler.live.entries import EntryChanges
from scheduler.live.feedback import EstimatorFeedback
from scheduler.live.inference import LiveInference
from scheduler.live.leadership import Leadership
from scheduler.live.liveness import NodeLiveness
from scheduler.live.models import JobModels
from scheduler.live.planner import RoundPlanner, configured_policy
from scheduler.live.plans import PlanStore
from scheduler.live.jobs import KnownJobs
from scheduler.live.progress import ProgressWriter
from scheduler.live.releases import ReleaseTracker
from scheduler.live.reports import TaskReports
from scheduler.live.resizes import CrashRestarts
from scheduler.live.rounds import RoundPacer
from scheduler.live.snapshot import SnapshotBuilder
from scheduler.policy import ClusterSnapshot
from silod.v1 import allocation_pb2, common_pb2, metadata_pb2_grpc, plan_pb2

_log = logging.getLogger("silod.scheduler")


class SchedulerCore:
    """What the servicers (scheduler.live.servicers.Scheduler) and the service call. Each part
    keeps its own state; this class only builds them, runs the round, and starts and stops
    the background tasks."""

    def __init__(self, metadata: metadata_pb2_grpc.MetadataServiceStub, *, policy: str, interval_s: float,
                 restart_cost_s: float, node_timeout_s: float, cache_mode: str,
                 node_poll_s: float = 1.0, inference_protect_scale: float = 1.0,
                 storage_bandwidth_bytes_per_s: float = 0.0, leadership: Leadership | None = None) -> None:
        self.policy_name = policy
        self.cache_mode = cache_mode
        self.policy, policy_co_designs = configured_policy(policy, cache_mode)
        # The cluster's remote-read budget; 0 = unlimited. Only a co-designing scheduler is told
        # of it (with an independent cache the scheduler is GPU-only, as in the simulator).
        storage_bandwidth = float(storage_bandwidth_bytes_per_s) if storage_bandwidth_bytes_per_s > 0 else math.inf
        self._background: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._node_task: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None
        # One scheduler unless --leader-election (scheduler.live.leadership): then only the leader
        # runs rounds and commits, each plan stamped with its epoch.
        self.leadership = leadership if leadership is not None else Leadership(enabled=False)

        self.clients = Clients(md=metadata)
        self.plans = PlanStore(self.clients)
        self.releases = ReleaseTracker()
        self.restarts = CrashRestarts()
        self.models = JobModels(self.clients)
        self.last_round_seconds: dict[str, float] = {}  # phase -> seconds, of the last round that finished
        self.rounds: RoundPacer[plan_pb2.AllocationPlan | None] = RoundPacer(
            self._round, interval_s=interval_s, uncounted_s=lambda: self.models.warm_up_s)
        self.liveness = NodeLiveness(self.clients, node_timeout_s=node_timeout_s, node_poll_s=node_poll_s,
                                     trigger=self.trigger)
        k = inference_protect_scale
        self.inference = LiveInference(  # inference tasks (DeepBoot ATS-I) beside the policy
            self.policy, LifecycleConfig(protect=ProtectSchedule(30.0 * k, 15.0 * k, 120.0 * k)))
        self.feedback = EstimatorFeedback(
            self.clients, self.models, cache_mode=cache_mode, storage_bandwidth_bytes_per_s=storage_bandwidth,
            node_types=lambda: self.snapshots.node_types, spawn=self.spawn)
        # The active jobs: read whole now and then, in between only what changed (scheduler.live.jobs).
        self.jobs = KnownJobs(self.clients)
        self.snapshots = SnapshotBuilder(
            self.clients, self.plans, self.liveness, self.models, self.inference, self.jobs,
            forget_finished=self._forget_finished, cache_mode=cache_mode, restart_cost_s=restart_cost_s,
            interval_s=interval_s, storage_bandwidth_bytes_per_s=storage_bandwidth)
        self.planner = RoundPlanner(self.policy, policy, policy_co_designs, cache_mode, self.inference)
        self.progress = ProgressWriter(lambda: self.clients.md)
        self.committer = Committer(self.clients, self.plans, self.releases, self.restarts, self.trigger, self.jobs)
        self.reports = TaskReports(self.clients, self.plans, self.releases, self.restarts, self.feedback,
                                   transition=self.committer.transition, trigger=self.trigger,
                                   jobs=self.jobs, progress=self.progress)

    # ---- the round -------------------------------------------------------------------------
    async def _round(self, reason: str) -> plan_pb2.AllocationPlan | None:
        if not self.leadership.leading:
            return None  # a standby: the leader runs rounds
        timer = metrics.RoundTimer()
        try:
            snap, jobs = await timer.timed("snapshot", self._snapshot())
            base = self.plans.latest
            # In a worker thread: at thousands of jobs the policy takes tenths of a second, and the
            # event loop must go on serving acks, reports and submissions meanwhile. What it reads
            # is this round's own (the snapshot, copies of the release and restart sets); only
            # rounds touch the planner and the inference state, one round at a time.
            proto = await timer.timed("policy", asyncio.to_thread(
                self.planner.plan, snap, jobs, self.snapshots.usable, base=base,
                busy=self.releases.busy(base, self.snapshots.current_from),
                restarting=frozenset(self.restarts.waiting), reason=reason,
                inference_jobs=self.snapshots.inference_jobs, training_ids=self.snapshots.training_ids,
                job_changes=self.jobs.changed_since))
            proto.epoch = self.leadership.epoch
            try:
                committed = await timer.timed(
                    "commit", self.committer.commit(proto, base, self.jobs.last_active, reason,
                                                    placements=self.planner.placements,
                                                    changes=self.planner.changes))
            except grpc.aio.AioRpcError as exc:
                if self.leadership.enabled and exc.code() == grpc.StatusCode.FAILED_PRECONDITION \
                        and "epoch" in (exc.details() or ""):
                    self.leadership.deposed(exc.details() or "")  # another scheduler leads now
                    timer.done("lost_race")
                    return None
                raise
        except Exception:
            timer.done("failed")
            raise
        metrics.jobs_seen(jobs, time.time(), changes=self.jobs.changes, active=self.jobs.last_active,
                          refresh=self.jobs.refreshes)
        if committed is not None:
            changes = self.plans.changes_from(base)
            metrics.plan_committed(committed, changes.previous if changes is not None else
                                   {a.job_id: a for a in (base.jobs if base is not None else [])},
                                   {node.name: node.pool for node in snap.nodes},
                                   changes)
        metrics.plan_in_force(self.plans.latest, snap, self.snapshots.usable.faulted, self.plans.changes_from)
        timer.done(self.committer.last_outcome)
        self.last_round_seconds = dict(timer.seconds)
        # One line a round: which one ran slow, and in which phase, beside the histogram.
        _log.info("round", extra={"reason": reason, "outcome": self.committer.last_outcome, "jobs": len(jobs),
                                  "seconds": {k: round(v, 3) for k, v in timer.seconds.items()}})
        return committed

    async def _snapshot(self) -> tuple[ClusterSnapshot, list[common_pb2.Job]]:
        await self.plans.refresh()
        return await self.snapshots.build()

    async def run_round(self, reason: str = "interval") -> plan_pb2.AllocationPlan | None:
        return await self.rounds.run(reason)

    def trigger(self, reason: str) -> None:
        self.rounds.trigger(reason)

    async def snapshot(self) -> tuple[ClusterSnapshot, list[common_pb2.Job]]:
        return await self.snapshots.build()

    def _forget_finished(self, active: set[str]) -> None:
        self.models.forget_finished(active)
        self.feedback.forget_finished(active)
        self.reports.forget_finished(active)

    async def warm_up(self, applications: Iterable[str] | None = None) -> None:
        await self.models.warm_up(applications)

    async def model_of(self, job: common_pb2.Job) -> tuple[JobModel, float]:
        return await self.models.model_of(job)

    # ---- what the servicers call -----------------------------------------------------------
    @property
    def md(self) -> metadata_pb2_grpc.MetadataServiceStub:
        return self.clients.md

    @md.setter  # the service sets the stubs once its event loop runs (scheduler.live.clients)
    def md(self, stub: metadata_pb2_grpc.MetadataServiceStub) -> None:
        self.clients.md = stub

    @property
    def estimator(self):  # type: ignore[no-untyped-def]
        return self.clients.estimator

    @estimator.setter
    def estimator(self, stub) -> None:  # type: ignore[no-untyped-def]
        self.clients.estimator = metrics.TimedEstimator(stub) if stub is not None else None

    @property
    def cached(self) -> CachedBytesProbe | None:
        return self.clients.cached

    @cached.setter
    def cached(self, probe: CachedBytesProbe | None) -> None:
        self.clients.cached = probe

    @property
    def node_set_version(self) -> int:
        return self.liveness.node_set_version

    @property
    def rank_room(self) -> frozenset[tuple[float, int]] | None:
        return self.liveness.rank_room

    async def read_rank_room(self) -> frozenset[tuple[float, int]]:
        return await self.liveness.read_rank_room()

    @property
    def latest(self) -> plan_pb2.AllocationPlan | None:
        return self.plans.latest

    @property
    def latest_version(self) -> int:
        return self.plans.latest_version

    @property
    def specs(self) -> dict[str, common_pb2.JobSpec]:
        return self.plans.specs

    @property
    def agent_addresses(self) -> dict[str, str]:
        return self.plans.agent_addresses

    @property
    def cache_addresses(self) -> dict[str, str]:
        return self.plans.cache_addresses

    def job_submitted(self, job: common_pb2.Job) -> None:
        self.plans.specs[job.id] = job.spec
        self.jobs.saw(job)
        self.trigger("arrival")

    def job_moved(self, job: common_pb2.Job) -> None:
        self.jobs.saw(job)

    def changes_from(self, plan: plan_pb2.AllocationPlan | None) -> EntryChanges | None:
        """What the plan in force changes of ``plan`` when ``plan`` is the one it replaced and this
        scheduler committed it (else None: compare the plans)."""
        return self.plans.changes_from(plan)

    async def refresh_latest(self, max_age_s: float = 0.0) -> plan_pb2.AllocationPlan | None:
        return await self.plans.refresh(max_age_s)

    async def wait_newer(self, version: int, timeout: float, node: str | None = None) -> None:
        await self.plans.wait_newer(version, timeout, node)

    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan:
        return await self.plans.node_plan(plan, node)

    def release(self, node: str, jobs: Iterable[str]) -> bool:
        return self.releases.release(node, jobs)

    async def report_tasks(self, request: allocation_pb2.ReportTasksRequest) -> list[str]:
        return await self.reports.report(request)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        # Profiles are fitted when a round first needs them, not here: fitting all of them
        # would compete with serving for seconds after every start.
        await self.leadership.check_supported(self.md)  # --leader-election on SQLite: a configuration error
        await self.plans.refresh()
        await self.releases.recover(self.md, self.plans.latest)
        self._loop_task = asyncio.create_task(self.rounds.loop())
        self._node_task = asyncio.create_task(self.liveness.watch())
        if self.leadership.enabled:
            self._lease_task = asyncio.create_task(self.leadership.run(self.md, self._elected))
        else:
            self.spawn(self.leadership.check_alone(self.md))

    async def _elected(self) -> None:
        """Won the lease: start from the store's view, as a restarted scheduler does."""
        await self.plans.refresh()
        await self.releases.recover(self.md, self.plans.latest)
        self.jobs.reset()
        self.trigger("elected")

    def spawn(self, call: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``call`` in the background, cancelled by stop()."""
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def stop(self) -> None:
        try:  # the progress taken in so far, before the stubs go
            await asyncio.wait_for(self.progress.flush(), timeout=5)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass
        for task in (self._lease_task, self._loop_task, self._node_task, *self._background):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        await self.leadership.step_down(self.md)  # rounds have stopped: a standby may take over now
