"""Measured throughput back to the estimator: rank 0's step times, sent to Observe in the
background, minus the measurements that show something other than the job's compute speed
(its start-up, its IO grant, a mix of GPU types)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping

import grpc

from scheduler.live import convert
from scheduler.live.clients import Clients
from scheduler.live.models import JobModels, application_of
from silod.v1 import allocation_pb2, common_pb2, estimator_pb2, plan_pb2

_log = logging.getLogger("silod.scheduler")

OBSERVE_TIMEOUT_S = 30.0  # in the background; a job's first Observe fits its profile in the estimator (seconds)
MAX_QUEUED_OBSERVATIONS = 100  # measurements of one job kept while the estimator is slow (the newest)
IO_BOUND_SHARE = 0.25  # a step whose misses, read at the job's IO grant, take this share of it measures data, not compute
WARMUP_STEPS = 2  # a job's first steps (connections, manifests, cold reads) are not its speed: not observed


class EstimatorFeedback:
    def __init__(self, clients: Clients, models: JobModels, *, cache_mode: str, storage_bandwidth_bytes_per_s: float,
                 node_types: Callable[[], Mapping[str, str]], spawn: Callable[[Awaitable[None]], None]) -> None:
        self.clients = clients
        self.models = models
        self.cache_mode = cache_mode
        self.storage_bandwidth_bytes_per_s = storage_bandwidth_bytes_per_s
        self._node_types = node_types  # node -> GPU type, as of the last snapshot
        self._spawn = spawn
        self._observe_failing = False  # logged once per outage, not once per job
        self._observing: dict[str, list[estimator_pb2.StepObservation]] = {}  # job -> measured while a call is in flight
        self._observed: dict[str, tuple] = {}  # job -> key of the last observation sent

    def forget_finished(self, active: set[str]) -> None:
        for job_id in self._observed.keys() - active:
            del self._observed[job_id]

    def observe(self, job: common_pb2.Job, entry: plan_pb2.JobAllocation, report: allocation_pb2.TaskReport) -> None:
        """Send rank 0's measured step time to the estimator's Observe, in the background: the
        report path must not wait for (or fail with) the estimator. One call per job in flight,
        measurements made meanwhile go together in the next; a report repeating the last
        measurement sends nothing."""
        if self.clients.estimator is None:
            return
        ranks = convert.ranks_of(entry)
        gpus, nodes = len(ranks), len({node for node, _ in ranks})
        batch = report.batch_size or entry.batch_size or job.spec.batch_size
        step = report.step_time_s
        if step <= 0 and report.progress.throughput_samples_per_s > 0:
            step = batch / report.progress.throughput_samples_per_s
        if gpus < 1 or batch < gpus or not 0 < step < math.inf:
            return  # nothing the estimator could fit (e.g. not measured yet)
        if report.progress.steps_done <= WARMUP_STEPS:
            return  # the job's first steps include its start-up: fitted as compute they shrank its demand
        if self.io_bound(job, entry, report, batch / step):
            return
        ran_on = {self._node_types().get(node, entry.gpu_type) for node, _ in ranks}
        if len(ran_on) > 1:
            return  # ranks on several types step at the slowest one's pace: no type's model measures that
        key = (entry.generation, gpus, batch, step, report.progress.steps_done)
        if self._observed.get(job.id) == key:
            return
        self._observed[job.id] = key
        observation = estimator_pb2.StepObservation(
            gpus=gpus, nodes=nodes, batch_size=batch, step_time_s=step,
            cache_hit_ratio=min(max(report.progress.cache_hit_ratio, 0.0), 1.0), gpu_type=ran_on.pop())
        if report.grad_sqr > 0 and math.isfinite(report.grad_sqr) and 0 <= report.grad_var < math.inf:
            observation.grad_sqr, observation.grad_var = report.grad_sqr, report.grad_var
        if job.id in self._observing:
            self._observing[job.id] = self._observing[job.id][-(MAX_QUEUED_OBSERVATIONS - 1):] + [observation]
            return
        self._observing[job.id] = []
        self._spawn(self._send_observations(job.id, application_of(job.spec), [observation]))

    def io_bound(self, job: common_pb2.Job, entry: plan_pb2.JobAllocation, report: allocation_pb2.TaskReport,
                  samples_per_s: float) -> bool:
        """Whether the measurement shows the job's granted remote IO rather than its compute.

        The estimator fits step times as compute (``T(g)``); a job held by its IO grant would
        be fitted as slow as the grant makes it, its demand ``b* = T s (1 - h)`` would shrink to
        that, and co_allocate would keep granting only that. Such measurements are not sent:
        the job's misses use at least IO_BOUND_SHARE of its grant, i.e. reading them at the
        grant takes that share of its step time (or it has no grant under a plan that manages
        IO: its cache server holds its misses). A low share on purpose: a step slower than its
        grant allows (CPU contention, lease round trips) is still waiting for data, and fitting
        it as compute starts the spiral above; a skipped measurement only keeps the model."""
        if self.cache_mode != "silod" or not job.spec.dataset or not entry.cache_grants:
            return False
        model = self.models.profiles.get(job.id)
        if model is None or model[0].bytes_per_sample <= 0:
            return False
        granted = sum(g.remote_io_bytes_per_s for g in entry.cache_grants)
        if granted <= 0:
            return math.isfinite(self.storage_bandwidth_bytes_per_s)
        miss = 1.0 - min(max(report.progress.cache_hit_ratio, 0.0), 1.0)
        return samples_per_s * model[0].bytes_per_sample * miss >= IO_BOUND_SHARE * granted

    async def _send_observations(self, job_id: str, application: str,
                                 observations: list[estimator_pb2.StepObservation]) -> None:
        try:
            while observations:
                await self._send_observation(estimator_pb2.ObserveRequest(
                    job_id=job_id, application=application, observations=observations))
                observations, self._observing[job_id] = self._observing[job_id], []
        finally:
            del self._observing[job_id]

    async def _send_observation(self, request: estimator_pb2.ObserveRequest) -> None:
        try:
            response = await self.clients.estimator.Observe(request, timeout=OBSERVE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if not self._observe_failing:
                self._observe_failing = True
                _log.warning("estimator Observe failed; measured throughput is not fed back until it succeeds again",
                             extra={"job_id": request.job_id, "code": exc.code().name, "details": exc.details()})
            return
        if self._observe_failing:
            self._observe_failing = False
            _log.info("estimator Observe works again", extra={"job_id": request.job_id})
        # The refitted model is in the answer: the next round uses it without asking again.
        self.models.set_fitted(request.job_id, dict(response.model.params), time.monotonic())
