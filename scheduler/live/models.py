"""Performance models of the live scheduler's jobs: the application profile's, the
estimator's fitted one when it has one, per GPU type, within the batch sizes the job allows.

Cost per round: one GetDataset per dataset new to the scheduler, one GetJobModel per job
whose fitted model is older than ESTIMATE_TTL_S (the estimator's answers to our own Observe
calls refresh it in between).

What a job's model is made of changes rarely (its profile never, its fitted parameters when the
estimator answers with new ones): :meth:`JobModels.watch_changes` tells which jobs' changed, so
that a snapshot makes the models of those only (scheduler.live.snapshot).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import grpc

from estimator.gpu_types import typed_models
from estimator.job_model import JobModel
from estimator.per_type import fitted_type_models
from scheduler.live.clients import Clients
from silod.v1 import common_pb2, metadata_pb2

_log = logging.getLogger("silod.scheduler")
T = TypeVar("T")

FALLBACK_APPLICATION = "cifar10"  # performance model of jobs whose application has no profile (command jobs)
ESTIMATE_TTL_S = 30.0  # a job's fitted model is re-read from the estimator at most this often ...
RPC_CONCURRENCY = 16  # ... and per-job calls of a round are sent this many at a time
ESTIMATOR_TIMEOUT_S = 2.0  # a round must not hang on a stuck estimator: the profile model will do


@functools.lru_cache(maxsize=1)
def known_applications() -> frozenset[str]:
    """The packaged profiles: read once (a directory listing), asked for every job of a round."""
    from estimator.profiles.loading import application_names

    return frozenset(application_names())


def application_of(spec: common_pb2.JobSpec) -> str:
    return spec.application if spec.application in known_applications() else FALLBACK_APPLICATION


class JobModels:
    """Per job: the profile model and samples to finish (fixed once submitted), and the
    estimator's fitted parameters with when they were read."""

    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self.profiles: dict[str, tuple[JobModel, float]] = {}  # job -> (profile model, samples to finish)
        # job -> (estimator params, monotonic read time); written through set_fitted only, which
        # tells the watchers (a snapshot keeps a job's model until told it changed).
        self.fitted: dict[str, tuple[dict[str, float] | None, float]] = {}
        self._watchers: list[set[str]] = []  # see watch_changes
        self._estimator_down = False  # logged once per outage, not once per job
        self.warm_up_s = 0.0  # spent fitting profiles: once per application, so not part of a round's cost

    async def warm_up(self, applications: Iterable[str] | None = None) -> None:
        """Fit the packaged profiles of ``applications`` (default: all), in a worker thread:
        seconds of CPU for all of them, which must not stall the event loop."""
        names = sorted(known_applications() if applications is None else set(applications))
        missing = [a for a in names if a not in _fitted_profiles]
        if missing:
            started = time.monotonic()
            await asyncio.to_thread(_fit_profiles, missing)
            self.warm_up_s += time.monotonic() - started

    def watch_changes(self) -> set[str]:
        """A set to which the id of every job whose fitted parameters change is added from now
        on: what model_now and type_models_now give for it may differ from what they gave
        before. The watcher takes the ids out as it deals with them.

        Profiles need no telling: one is made on the job's first model_now and never changes
        (nor the datasets, read for it only). Models per GPU type are made of the job's model
        and fitted parameters and the types asked for, which the caller knows."""
        changed: set[str] = set()
        self._watchers.append(changed)
        return changed

    def set_fitted(self, job_id: str, params: dict[str, float] | None, read_at: float) -> None:
        """The estimator's parameters of ``job_id`` (None: it has none), as read at ``read_at``."""
        before = self.fitted.get(job_id)
        self.fitted[job_id] = (params, read_at)
        if (before[0] if before is not None else None) != params:
            for changed in self._watchers:
                changed.add(job_id)

    def forget_finished(self, active: set[str]) -> None:
        for cache in (self.profiles, self.fitted):
            for job_id in cache.keys() - active:  # a set difference in C: 20,000 jobs cost a millisecond
                del cache[job_id]

    def profile_model(self, job: common_pb2.Job, datasets: dict[str, common_pb2.Dataset | None]) -> tuple[JobModel, float]:
        """(profile model, samples to finish) of ``job``, cached per job: neither changes once submitted."""
        if job.id in self.profiles:
            return self.profiles[job.id]
        spec = job.spec
        model = JobModel.from_profile(application_of(spec))
        samples_per_epoch = model.dataset_bytes / model.bytes_per_sample if model.bytes_per_sample else 1.0
        ds = datasets.get(spec.dataset) if spec.dataset else None
        if ds is not None and ds.total_bytes > 0 and ds.num_objects > 0:
            model = model.with_dataset(ds.total_bytes, ds.total_bytes / ds.num_objects)
            samples_per_epoch = float(ds.num_objects)
        budget = spec.WhichOneof("budget")
        if budget == "sample_budget":
            target = float(spec.sample_budget)
        elif budget == "epochs":
            target = spec.epochs * samples_per_epoch
        else:
            target = samples_per_epoch
        self.profiles[job.id] = (model, max(target, 1.0))
        return self.profiles[job.id]

    async def datasets_of(self, jobs: list[common_pb2.Job]) -> dict[str, common_pb2.Dataset | None]:
        """One GetDataset per dataset named by a job the scheduler has no model of yet."""
        names = {j.spec.dataset for j in jobs if j.spec.dataset and j.id not in self.profiles}

        async def get(name: str) -> common_pb2.Dataset | None:
            try:
                return await self.clients.md.GetDataset(metadata_pb2.GetDatasetRequest(name=name))
            except grpc.aio.AioRpcError:
                return None

        found = await bounded_gather([get(name) for name in sorted(names)])
        return dict(zip(sorted(names), found))

    async def refresh_fitted(self, job_ids: list[str]) -> None:
        """Re-read from the estimator the fitted models of ``job_ids`` older than ESTIMATE_TTL_S."""
        estimator = self.clients.estimator
        if estimator is None:
            return
        now = time.monotonic()
        never = (None, -math.inf)
        fitted = self.fitted
        stale = [job_id for job_id in job_ids if now - fitted.get(job_id, never)[1] >= ESTIMATE_TTL_S]
        if self._estimator_down:
            stale = stale[:1]  # one probe per round until it answers, not a timeout per job

        async def get(job_id: str) -> None:
            try:
                params = await estimator.GetJobModel(common_pb2.GetJobModelRequest(job_id=job_id),
                                                     timeout=ESTIMATOR_TIMEOUT_S)
                self.set_fitted(job_id, dict(params.params), now)
                self._estimator_down = False
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self.set_fitted(job_id, None, now)  # not observed yet: the profile's model
                    return
                # Remembered too, so that an estimator outage costs one timeout per job per TTL, not per round.
                self.set_fitted(job_id, self.fitted.get(job_id, (None, 0.0))[0], now)
                if not self._estimator_down:
                    self._estimator_down = True
                    _log.warning("estimator unavailable; using the profile models",
                                 extra={"job_id": job_id, "code": exc.code().name})

        await bounded_gather([get(job_id) for job_id in stale])

    async def model_of(self, job: common_pb2.Job) -> tuple[JobModel, float]:
        """(performance model, samples to finish) of ``job``: the estimator's fitted model when
        one is known, else the application profile's."""
        await self.warm_up([application_of(job.spec)])
        datasets = await self.datasets_of([job])
        await self.refresh_fitted([job.id])
        return self.model_now(job, datasets)

    def model_now(self, job: common_pb2.Job, datasets: dict[str, common_pb2.Dataset | None]) -> tuple[JobModel, float]:
        profile, target = self.profile_model(job, datasets)
        params = self.fitted.get(job.id, (None, 0.0))[0]
        if params is None:
            return with_job_batch_bounds(profile, job.spec), target
        try:
            return with_job_batch_bounds(JobModel.from_params(profile.application, params), job.spec), target
        except (ValueError, KeyError):
            _log.warning("estimator returned an unusable model; using the profile model", extra={"job_id": job.id})
            self.set_fitted(job.id, None, self.fitted[job.id][1])
            return profile, target

    def type_models_now(self, job: common_pb2.Job, model: JobModel, gpu_types: tuple[str, ...]) -> dict[str, JobModel]:
        """``job``'s model on each of ``gpu_types``: the estimator's fit on a type the job ran on
        (GetJobModel / Observe answers carry one per type), else ``model`` scaled by the
        measured table (estimator.gpu_types)."""
        typed = _typed_models(model, gpu_types)
        params = self.fitted.get(job.id, (None, 0.0))[0]
        if not params or not any(key.startswith("type[") for key in params):
            return typed
        try:
            fitted = fitted_type_models(model, params)
        except ValueError as exc:
            _log.warning("estimator returned unusable per-type models; using the scaled ones",
                         extra={"job_id": job.id, "error": str(exc)})
            return typed
        return {t: fitted.get(t, typed.get(t)) for t in typed}


_fitted_profiles: set[str] = set()
_profile_lock = threading.Lock()


def _fit_profiles(applications: list[str]) -> None:
    """JobModel.from_profile caches its result; the lock keeps two threads from fitting one
    profile twice, and is taken per application so a round waits for at most one foreign fit."""
    for application in applications:
        with _profile_lock:
            if application not in _fitted_profiles:
                JobModel.from_profile(application)
                _fitted_profiles.add(application)


def with_job_batch_bounds(model: JobModel, spec: common_pb2.JobSpec) -> JobModel:
    """``model`` with the batch sizes the job's owner allows: ``batch_size`` is B0 (the batch the
    job starts with, and the one its gradient statistics are reported at: SILOD_BASE_BATCH_SIZE)
    and ``max_batch_size`` (0: ``batch_size``, the contract's default) the most a goodput policy
    may retune it to. The profile's bounds describe the profiled model, not this job: left alone,
    a policy scaled a job that allows 64 samples a step to 1,300.

    A profile's gradient variance is expressed at the profile's B0; it is rescaled to the job's,
    which keeps the noise scale ``B0 * var / sqr``. Measured statistics are already at the job's.
    """
    if spec.batch_size <= 0:
        return model
    # Every job of an application shares its profile's model: remembered per (model, bounds), a
    # round at 5,000 jobs builds a handful of models instead of 5,000.
    key = (id(model), spec.batch_size, spec.max_batch_size, spec.max_gpus)
    hit = _BOUNDED.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    bounded = _with_job_batch_bounds(model, spec)
    if len(_BOUNDED) >= 16_384:  # fitted models are new objects each round: never let them pile up
        _BOUNDED.clear()
    _BOUNDED[key] = (model, bounded)
    return bounded


_BOUNDED: dict[tuple[int, int, int, int], tuple[JobModel, JobModel]] = {}


def _with_job_batch_bounds(model: JobModel, spec: common_pb2.JobSpec) -> JobModel:
    bounds = model.bounds
    init = spec.batch_size
    top = max(spec.max_batch_size or init, init)
    grad = model.grad
    if model.grad_reports == 0 and init != bounds.init_batch_size:
        grad = grad._replace(var=grad.var * bounds.init_batch_size / init)
    # The batch is split over up to max_gpus ranks: a per-GPU floor above init / max_gpus would
    # push a widened job's batch over what it allows.
    min_local = min(bounds.min_local_bsz, max(1, init // max(spec.max_gpus, 1)))
    new_bounds = bounds._replace(init_batch_size=init, max_batch_size=top, min_local_bsz=min_local,
                                 max_local_bsz=max(bounds.max_local_bsz, min_local))
    if new_bounds == bounds and grad == model.grad:
        return model
    return dataclasses.replace(model, bounds=new_bounds, grad=grad)


@functools.lru_cache(maxsize=4096)
def _typed_models(model: JobModel, gpu_types: tuple[str, ...]) -> dict[str, JobModel]:
    """A job model's per-type models (estimator.gpu_types); jobs of one application share one."""
    return typed_models(model, gpu_types)


async def bounded_gather(calls: list[Awaitable[T]], limit: int = RPC_CONCURRENCY) -> list[T]:
    """Await ``calls`` with at most ``limit`` in flight; results in order, first exception raised
    once all have finished (none is left running unobserved)."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
