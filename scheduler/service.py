"""``silod scheduler``: JobService (job front door) and AllocationService (versioned plans),
plus the scheduling rounds that run the configured policy (see scheduler/live/)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from pydantic import Field, field_validator, model_validator

from silod.rpc.channels import open_channel
from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings, at_least, refuse
from silod.v1 import allocation_pb2_grpc, estimator_pb2_grpc, metadata_pb2_grpc, scheduler_pb2_grpc

_log = logging.getLogger("silod.scheduler")
# What a metadata service that is not up yet answers: waited for at start, as the agents, cache
# servers and allocation servers wait for it, rather than exiting (any other refusal still does).
_NOT_UP_YET = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
START_RETRY_MAX_S = 5.0


class Settings(ServiceSettings):
    metadata_address: str = Field(
        "", validate_default=True, description="HOST:PORT of the metadata service (required)")
    estimator_address: str = Field(
        "", description="HOST:PORT of the estimator service (fitted job models, GetJobModel); "
        "empty = job models from the packaged application profiles")
    policy: str = Field("fifo", description="Scheduling policy: fifo, sjf, tiresias, gavel, themis, pollux or deepboot")
    interval_s: float = Field(10.0, gt=0, le=3600, description="Seconds between regular scheduling rounds")
    restart_cost_s: float = Field(30.0, ge=0, description="Seconds a job loses when its placement changes")
    node_timeout_s: float = Field(
        15.0, gt=0, description="Seconds since its last heartbeat after which a node's jobs are requeued; at least "
        "3x the nodes' heartbeat_s: a worker agent that heartbeats less often is refused its plan watch and exits "
        "naming both settings")
    cache_mode: str = Field(
        "silod", description="Cache mode: silod (co-allocated cache quotas and IO rates), lru (shared LRU "
        "cache), static (equal cache shares per node) or none (no cache); sent to the cache servers on the plans")
    storage_bandwidth_bytes_per_s: float = Field(
        0.0, ge=0, description="Bytes/s the cluster may read from remote storage in total, shared out by "
        "--cache-mode silod as per-job IO rates; 0 = unlimited")
    metadata_timeout_s: float = Field(10.0, gt=0, description="Seconds a unary call to the metadata service may take")
    leader_election: bool = Field(
        False, description="Run as one of several schedulers: only the holder of the leadership lease in the "
        "metadata store runs rounds and commits plans; the others stand by and take over once it lapses "
        "(docs/operators.md, High availability). Off = the only scheduler")
    advertise_address: str = Field(
        "", description="HOST:PORT the nodes reach this scheduler at, recorded with the lease (--leader-election); "
        "empty = the bound listen address")
    lease_ttl_s: float = Field(5.0, ge=0.5, le=300, description="Seconds the leadership lease lasts unless renewed; "
                               "at least 3x lease_renew_s")
    lease_renew_s: float = Field(1.0, gt=0, le=60, description="Seconds between lease renewals (and a standby's tries)")
    inference_protect_scale: float = Field(
        1.0, gt=0, description="Scale of an inference replica's protect time after its task "
        "(DeepBoot: 30 s + 15 s per reuse, at most 120 s, times this)")

    @model_validator(mode="after")
    def _lease_outlasts_renewals(self) -> Settings:
        if self.leader_election:
            refuse([at_least(self, "lease_ttl_s", 3, "lease_renew_s",
                             "the leader must renew at least twice within the share of the lease it counts on "
                             "(0.8 x lease_ttl_s), or one slow renewal stops a healthy leader")])
        return self

    @field_validator("metadata_address")
    @classmethod
    def _metadata_required(cls, value: str) -> str:
        if not value:
            raise ValueError("required: HOST:PORT of silod metadata")
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from scheduler.registry import policy_names

        names = policy_names()
        if value not in names:
            raise ValueError(f"unknown policy {value!r}; known: {', '.join(names)}")
        return value

    @field_validator("cache_mode")
    @classmethod
    def _known_cache_mode(cls, value: str) -> str:
        if value not in ("silod", "lru", "static", "none"):
            raise ValueError(f"unknown cache mode {value!r}; known: silod, lru, static, none")
        return value


def definition(settings: Settings) -> ServiceDefinition:
    from scheduler.live.core import SchedulerCore
    from scheduler.live.data import CachedBytesProbe
    from scheduler.live.feed import PlanFeedService
    from scheduler.live.leadership import Leadership
    from scheduler.live.servicers import AllocationService, JobService

    leadership = None
    if settings.leader_election:
        from scheduler.live.leadership import reachable_address

        settings.listen, address = reachable_address(settings.listen)  # the lease names a concrete address
        leadership = Leadership(enabled=True, address=settings.advertise_address or address,
                                ttl_s=settings.lease_ttl_s, renew_s=settings.lease_renew_s)
    core = SchedulerCore(
        None, leadership=leadership, policy=settings.policy, interval_s=settings.interval_s,
        restart_cost_s=settings.restart_cost_s, node_timeout_s=settings.node_timeout_s, cache_mode=settings.cache_mode,
        inference_protect_scale=settings.inference_protect_scale,
        storage_bandwidth_bytes_per_s=settings.storage_bandwidth_bytes_per_s,
    )

    def register(server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_JobServiceServicer_to_server(JobService(core), server)
        allocation_pb2_grpc.add_AllocationServiceServicer_to_server(AllocationService(core), server)
        # The allocation servers' feed (silod allocation): each committed plan once, acks and reports back.
        allocation_pb2_grpc.add_PlanFeedServiceServicer_to_server(
            PlanFeedService(core, node_timeout_s=settings.node_timeout_s), server)

    channels = []

    async def on_start() -> None:
        # Created here: an aio channel belongs to the event loop that serves.
        channel = open_channel(settings.metadata_address, token=settings.auth_token, aio=True,
                               default_timeout_s=settings.metadata_timeout_s)
        channels.append(channel)
        core.md = metadata_pb2_grpc.MetadataServiceStub(channel)
        if settings.cache_mode == "silod":  # what the cache servers hold, for co_allocate's IO demands
            core.cached = CachedBytesProbe(lambda address: open_channel(
                address, token=settings.auth_token, aio=True, default_timeout_s=settings.metadata_timeout_s))
        if settings.estimator_address:
            estimator = open_channel(settings.estimator_address, token=settings.auth_token, aio=True,
                                     default_timeout_s=settings.metadata_timeout_s)
            channels.append(estimator)
            core.estimator = estimator_pb2_grpc.EstimatorServiceStub(estimator)
        await _start_once_metadata_answers(core, settings.metadata_address)

    async def on_stop() -> None:
        await core.stop()
        if core.cached is not None:
            await core.cached.close()
        for channel in channels:
            await channel.close()

    service = ServiceDefinition(
        name="scheduler", service_names=["silod.v1.JobService", "silod.v1.AllocationService",
                                           "silod.v1.PlanFeedService"],
        register=register, on_start=on_start, on_stop=on_stop,
    )
    service.core = core  # type: ignore[attr-defined]  # for in-process tests
    return service


async def _start_once_metadata_answers(core, metadata_address: str) -> None:  # type: ignore[no-untyped-def]
    """core.start(), again after a pause while the metadata service is not up yet (started at the
    same time, restarting, or a wrong address: each try is logged with the address and the error).
    The port opens only once it has started, so health checks fail meanwhile. core.start() only
    reads until it succeeds, so a try cut short is harmless; SIGTERM meanwhile stops the process."""
    pause = 0.5
    while True:
        try:
            await core.start()
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _NOT_UP_YET:
                raise
            _log.warning("metadata service not answering; trying again", extra={
                "metadata": metadata_address, "code": exc.code().name, "details": exc.details(), "retry_in_s": pause})
        await asyncio.sleep(pause)
        pause = min(pause * 2, START_RETRY_MAX_S)
