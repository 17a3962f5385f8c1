"""JobService and AllocationService servicers: validation and forwarding to the metadata store,
state-driving calls handed to the scheduler through the narrow :class:`Scheduler` interface
(scheduler.live.core.SchedulerCore implements it)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from scheduler.live import metrics
from scheduler.live.acks import AckForwarder
from scheduler.live.clients import ACTIVE_STATES, TERMINAL_STATES
from scheduler.live.models import known_applications
from scheduler.live.node_requests import check_ack, check_report_tasks, counts_as_node_ack
from scheduler.live.watch import require_leader, watch_node
from services.metadata.validation.jobs import check_client_request_id, job_spec_problems
from services.runtime import downstream
from services.runtime.batching import Coalescer
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, Problems, ServiceError
from silod.v1 import (
    allocation_pb2,
    allocation_pb2_grpc,
    common_pb2,
    metadata_pb2,
    plan_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

T = TypeVar("T")
_log = logging.getLogger("silod.scheduler")
WATCH_POLL_S = 0.5
ADMISSION_CACHE_S = 5.0


class ForwardedError(ServiceError):
    """The outcome of one submission that the metadata service refused (or that could not be
    forwarded), passed on with its code and message."""

    def __init__(self, *, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN, details: str = "") -> None:
        super().__init__(details or code.name, code=code)


async def forward(call: Awaitable[T], what: str = "metadata service",
                  fields: Mapping[str, str] | None = downstream.PASS_THROUGH) -> T:
    """``await call`` with a metadata failure answered by the shared rule
    (services/runtime/downstream.py); by default the caller's request went down as it came,
    so a refusal names the caller's own field. ``fields=None``: this service made the request."""
    return await downstream.forward(call, what, fields)


class Scheduler(Protocol):
    """What the servicers need of the scheduler: the metadata stub to forward to, the plan in
    force and its node views, and the events that trigger rounds."""

    @property
    def md(self) -> Any: ...  # metadata_pb2_grpc.MetadataServiceStub
    @property
    def node_set_version(self) -> int: ...  # changes whenever the set of live nodes does
    @property
    def rank_room(self) -> frozenset[tuple[float, int]] | None: ...  # (cores, bytes) of live training nodes; None = none listed yet
    async def read_rank_room(self) -> frozenset[tuple[float, int]]: ...  # the same, listed afresh
    @property
    def latest(self) -> plan_pb2.AllocationPlan | None: ...
    @property
    def latest_version(self) -> int: ...

    def spawn(self, call: Awaitable[None]) -> None: ...  # in the background, cancelled when the scheduler stops
    def trigger(self, reason: str) -> None: ...
    def job_submitted(self, job: common_pb2.Job) -> None: ...
    def job_moved(self, job: common_pb2.Job) -> None: ...  # a state move made here (a cancel)
    def release(self, node: str, jobs: Iterable[str]) -> bool: ...
    async def report_tasks(self, request: allocation_pb2.ReportTasksRequest) -> list[str]: ...
    async def refresh_latest(self, max_age_s: float = 0.0) -> plan_pb2.AllocationPlan | None: ...
    async def wait_newer(self, version: int, timeout: float, node: str | None = None) -> None: ...
    async def node_plan(self, plan: plan_pb2.AllocationPlan, node: str) -> plan_pb2.NodePlan: ...


MAX_CREATIONS = 1000  # jobs per CreateJobs call (the metadata service's limit)
class _Creations:
    """Concurrent submissions go to the metadata service together, as CreateJobs calls
    (services.runtime.batching: those arriving while a call is in flight make the next one).
    Each keeps its own outcome (a refused one fails with CreateJob's code and message); when the
    scheduler stops, a submission in flight fails CANCELLED and a queued one UNAVAILABLE. A
    metadata service without CreateJobs gets one CreateJob per submission, as before.
    """

    def __init__(self, core: Scheduler) -> None:
        self.core = core
        self._batched = True
        self._calls: Coalescer[metadata_pb2.CreateJobRequest, common_pb2.Job] = Coalescer(
            self._send_batch, MAX_CREATIONS, spawn=core.spawn, stopped=_stopping)

    async def create(self, request: metadata_pb2.CreateJobRequest) -> common_pb2.Job:
        if not self._batched:
            return await forward(self.core.md.CreateJob(request))
        return await self._calls.submit(request)

    async def _send_batch(self, batch: Sequence[metadata_pb2.CreateJobRequest]) -> list[common_pb2.Job | BaseException]:
        try:
            outcomes = await self._create_jobs(batch)
        except Exception:  # a bug: its submissions fail (INTERNAL), later ones still go
            _log.exception("forwarding submissions failed")
            outcomes = []
        # Nobody may wait forever, whatever happened (e.g. fewer results than requests).
        return outcomes + [ForwardedError(code=grpc.StatusCode.INTERNAL, details="submission not forwarded (see the "
                                          "scheduler log)")] * (len(batch) - len(outcomes))

    async def _create_jobs(self, batch: Sequence[metadata_pb2.CreateJobRequest]) -> list[common_pb2.Job | BaseException]:
        try:
            reply = await self.core.md.CreateJobs(metadata_pb2.CreateJobsRequest(jobs=list(batch)))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                error = downstream.translate(exc, "metadata CreateJobs", downstream.PASS_THROUGH)
                return [ForwardedError(code=error.code, details=str(error)) for _ in batch]
            self._batched = False  # an older metadata service: one call each from now on
            return list(await asyncio.gather(*(forward(self.core.md.CreateJob(r)) for r in batch),
                                             return_exceptions=True))
        outcomes: list[common_pb2.Job | BaseException] = []
        for result in reply.results[:len(batch)]:
            if result.error_code:
                code = getattr(grpc.StatusCode, result.error_code, grpc.StatusCode.UNKNOWN)
                outcomes.append(ForwardedError(code=code, details=result.error))
            else:
                outcomes.append(result.job)
        return outcomes


def _stopping(in_flight: bool) -> ForwardedError:
    if in_flight:
        return ForwardedError(code=grpc.StatusCode.CANCELLED, details="the scheduler stopped while forwarding this submission")
    return ForwardedError(code=grpc.StatusCode.UNAVAILABLE, details="the scheduler is stopping")


class JobService(scheduler_pb2_grpc.JobServiceServicer):
    @property
    def md(self):  # the metadata stub exists once the server started
        return self.core.md

    def __init__(self, core: Scheduler) -> None:
        self.core = core
        self._creations = _Creations(core)
        # Admission checks that need not hit the metadata store on every submission: datasets
        # are not deleted and clusters rarely shrink, so a positive answer is reused briefly.
        self._datasets_seen: dict[str, float] = {}
        self._gpu_count = (0, -math.inf, 0)  # (training GPUs, when counted, core.node_set_version then)
        self._counting: asyncio.Future[int] | None = None  # the count in flight, shared by submissions

    @staticmethod
    def _recently_seen(seen: dict[str, float], key: str) -> bool:
        return time.monotonic() - seen.get(key, -math.inf) < ADMISSION_CACHE_S

    def _admitted_by_recent_count(self, min_gpus: int) -> bool:
        total, counted_at, node_set_version = self._gpu_count
        fresh = time.monotonic() - counted_at < ADMISSION_CACHE_S and node_set_version == self.core.node_set_version
        return fresh and (total == 0 or min_gpus <= total)

    async def _count_training_gpus(self) -> int:
        """The training GPUs of every registered node, counted afresh; submissions arriving while
        a count is in flight share it (with a thousand nodes, a ListNodes per submission was a
        herd whenever the node set changed)."""
        if self._counting is None:
            async def count() -> int:
                started = time.monotonic()
                nodes = await forward(self.md.ListNodes(metadata_pb2.ListNodesRequest(
                    pool=common_pb2.NODE_POOL_UNSPECIFIED)), "metadata ListNodes", None)
                total = sum(n.spec.gpus for n in nodes.nodes if n.spec.pool != common_pb2.NODE_POOL_INFERENCE)
                self._gpu_count = (total, started, self.core.node_set_version)
                return total

            self._counting = asyncio.ensure_future(count())
            self._counting.add_done_callback(lambda _: setattr(self, "_counting", None))
        return await asyncio.shield(self._counting)

    async def SubmitJob(self, request, context):  # noqa: N802
        spec = request.spec
        # Every problem of the spec at once (the metadata service's own rules, and the profile).
        problems = Problems()
        job_spec_problems(spec, "spec", problems)
        if (spec.application and not spec.command and spec.kind != common_pb2.JOB_KIND_INFERENCE
                and spec.application not in known_applications()):
            problems.add("spec.application",
                         f"no profile for application {spec.application!r} (known: {', '.join(sorted(known_applications()))}); "
                         "set command to run your own program")
        problems.check(check_client_request_id, request.client_request_id)
        problems.raise_if_any()
        if spec.dataset and not self._recently_seen(self._datasets_seen, spec.dataset):
            try:
                await self.md.GetDataset(metadata_pb2.GetDatasetRequest(name=spec.dataset))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise NotFound(f"no dataset named {spec.dataset!r} is registered", field="spec.dataset") from None
                raise downstream.translate(exc, "metadata GetDataset", {"name": "spec.dataset"}) from None
            self._datasets_seen[spec.dataset] = time.monotonic()
        # A recent count that already admits the job (no nodes yet admits any) saves listing
        # every node per submission; a rejection is always decided on a fresh count.
        if 1 <= spec.min_gpus <= spec.max_gpus and not self._admitted_by_recent_count(spec.min_gpus):
            total = await self._count_training_gpus()
            if total and spec.min_gpus > total:
                raise FailedPrecondition(
                    f"{spec.min_gpus} GPUs can never be granted: the cluster has {total} training GPUs",
                    field="spec.min_gpus")
        if spec.kind != common_pb2.JOB_KIND_INFERENCE and (spec.cpus_per_rank > 0 or spec.memory_bytes_per_rank > 0):
            await self._refuse_ranks_no_node_holds(spec)
        job = await self._creations.create(
            metadata_pb2.CreateJobRequest(spec=spec, client_request_id=request.client_request_id))
        self.core.job_submitted(job)
        return job

    async def _refuse_ranks_no_node_holds(self, spec: common_pb2.JobSpec) -> None:
        """FAILED_PRECONDITION when no live training node could ever hold one rank of ``spec``:
        decided on the nodes the scheduler last listed (no read per submission), confirmed on a
        fresh listing before refusing (a bigger node may just have joined). No node known: accepted."""
        def holds(room: frozenset[tuple[float, int]]) -> bool:
            return any(spec.cpus_per_rank <= cpus and spec.memory_bytes_per_rank <= memory for cpus, memory in room)

        room = self.core.rank_room
        if not room or holds(room):
            return
        try:
            room = await self.core.read_rank_room()
        except grpc.aio.AioRpcError:
            return  # not confirmed: accepted (placement still puts its ranks only where they fit)
        if not room or holds(room):
            return
        most_cpus, most_memory = max(cpus for cpus, _ in room), max(memory for _, memory in room)
        if spec.cpus_per_rank > most_cpus:
            raise FailedPrecondition(f"{spec.cpus_per_rank:g} cores per rank can never be granted: no live training "
                                     f"node offers ranks more than {most_cpus:g}", field="spec.cpus_per_rank")
        if spec.memory_bytes_per_rank > most_memory:
            raise FailedPrecondition(f"{spec.memory_bytes_per_rank} bytes of memory per rank can never be granted: no "
                                     f"live training node offers ranks more than {most_memory}",
                                     field="spec.memory_bytes_per_rank")
        raise FailedPrecondition(f"no live training node offers both {spec.cpus_per_rank:g} cores and "
                                 f"{spec.memory_bytes_per_rank} bytes of memory to a rank", field="spec.cpus_per_rank")

    async def GetJob(self, request, context):  # noqa: N802
        return await forward(self.md.GetJob(request))

    async def ListJobs(self, request, context):  # noqa: N802
        return await forward(self.md.ListJobs(request))

    async def CancelJob(self, request, context):  # noqa: N802
        if not request.job_id:
            raise InvalidArgument("required", field="job_id")
        for _ in range(5):
            job = await forward(self.md.GetJob(metadata_pb2.GetJobRequest(job_id=request.job_id)))
            if job.state in TERMINAL_STATES:
                raise FailedPrecondition(
                    f"job {job.id} is already {common_pb2.JobState.Name(job.state)}", field="job_id")
            try:
                job = await self.md.TransitionJob(metadata_pb2.TransitionJobRequest(
                    job_id=job.id, expected_state=job.state, new_state=common_pb2.JOB_STATE_CANCELLED,
                    message=request.reason or "cancelled"))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    continue  # the state moved under us: re-read
                raise downstream.translate(exc, "metadata TransitionJob", {"job_id": "job_id", "message": "reason"}) from None
            self.core.job_moved(job)
            self.core.trigger("cancel")
            return job
        raise FailedPrecondition("job state keeps changing; retry", field="job_id")

    async def WatchJob(self, request, context) -> AsyncIterator[scheduler_pb2.JobUpdate]:  # noqa: N802
        if not request.job_id:
            raise InvalidArgument("required", field="job_id")
        job = await forward(self.md.GetJob(metadata_pb2.GetJobRequest(job_id=request.job_id)))
        events = await forward(self.md.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=job.id)))
        last_seq = max((e.sequence for e in events.events), default=0)
        yield scheduler_pb2.JobUpdate(job=job)
        last = job
        while job.state not in TERMINAL_STATES:
            await asyncio.sleep(WATCH_POLL_S)
            events = await forward(self.md.ListJobEvents(
                metadata_pb2.ListJobEventsRequest(job_id=job.id, after_sequence=last_seq)))
            job = await forward(self.md.GetJob(metadata_pb2.GetJobRequest(job_id=job.id)))
            for event in events.events:
                last_seq = event.sequence
                yield scheduler_pb2.JobUpdate(job=job, event=event)
            if not events.events and (job.progress != last.progress or job.state_version != last.state_version):
                yield scheduler_pb2.JobUpdate(job=job)
            last = job

    async def RegisterDataset(self, request_iterator, context):  # noqa: N802
        return await downstream.forward_stream(request_iterator, self.md.RegisterDataset, "metadata RegisterDataset")

    async def GetDataset(self, request, context):  # noqa: N802
        return await forward(self.md.GetDataset(request))

    async def ListDatasets(self, request, context):  # noqa: N802
        return await forward(self.md.ListDatasets(request))


class AllocationService(allocation_pb2_grpc.AllocationServiceServicer):
    @property
    def md(self):
        return self.core.md

    def __init__(self, core: Scheduler, *, refresh_s: float = 5.0) -> None:
        self.core = core
        self.refresh_s = refresh_s
        # A node's acked version is written at most as often as a node heartbeats (a third of
        # the node timeout, 5 s at least): at thousands of nodes these writes are most of the
        # metadata service's work, and the node's heartbeats carry the same version anyway.
        self.node_timeout_s = node_timeout_s = getattr(getattr(core, "liveness", None), "node_timeout_s", 15.0)
        self.acks = AckForwarder(lambda: self.md, every_s=max(5.0, node_timeout_s / 3))

    async def CommitPlan(self, request, context):  # noqa: N802
        plan = await forward(self.md.CommitPlan(metadata_pb2.CommitPlanRequest(plan=request.plan)), "metadata CommitPlan",
                             {"plan": "plan"})
        await self.core.refresh_latest()
        return plan

    async def GetLatestPlan(self, request, context):  # noqa: N802
        return await forward(self.md.GetLatestPlan(metadata_pb2.GetLatestPlanRequest()))

    async def Watch(self, request, context):  # noqa: N802
        # scheduler/live/watch.py: the leader's node views and heartbeats; a node heartbeating
        # too seldom for the node timeout is refused.
        async for node_plan in watch_node(self.core, request, refresh_s=self.refresh_s,
                                          node_timeout_s=self.node_timeout_s):
            yield node_plan

    async def Ack(self, request, context):  # noqa: N802
        check_ack(request)
        require_leader(self.core)
        # Releases first: they live in this process and free GPUs for the next round, so a
        # metadata service that is down (or slow) must not lose or delay them.
        if request.released_jobs and self.core.release(request.node, request.released_jobs):
            self.core.trigger("release")
        if counts_as_node_ack(request):
            metrics.node_acked(request.node, request.version)
            self.acks.add(request.node, request.version)  # written to the store after this answer
        return allocation_pb2.AckPlanResponse(latest_version=self.core.latest_version)

    async def ReportTasks(self, request, context):  # noqa: N802
        check_report_tasks(request)
        require_leader(self.core)  # job states are written by the leader only
        # What reaches the metadata service from here was checked above: a refusal is a bug.
        acknowledged = await forward(self.core.report_tasks(request), "metadata (task reports)", None)
        return allocation_pb2.ReportTasksResponse(acknowledged_exits=acknowledged)


__all__ = ["JobService", "AllocationService", "ACTIVE_STATES", "require_leader"]
