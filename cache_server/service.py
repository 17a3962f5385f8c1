"""``silod cache-server``: the per-node dataset cache (memory and disk tiers in front of
``file://`` / ``s3://`` stores), serving local jobs by lease (file paths, no bytes through
gRPC) and remote readers by stream. See docs/cache.md.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from typing import Any, Literal

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import Field, field_validator, model_validator

from cache_server.core import CacheConfig, CacheCore
from cache_server.peers import PeerReader
from cache_server.tiers import TierLocked
from services.runtime.auth import auth_enabled, caller_token
from services.runtime.node_settings import PlanFollowerSettings
from services.runtime.server import ServiceDefinition, StartupError
from services.runtime.settings import ServiceSettings, at_least, refuse
from services.runtime.structured_logging import get_logger
from silod.data.catalog import load_manifest_async
from silod.v1 import cache_pb2, cache_pb2_grpc, metadata_pb2, metadata_pb2_grpc

_log = get_logger("silod.cache")

CHUNK_BYTES = 1 << 20  # ReadChunk.data limit
SHM = "/dev/shm"


class Settings(PlanFollowerSettings):
    metadata_address: str = Field("127.0.0.1:7070", description="HOST:PORT of the metadata service (manifests)")
    metadata_tls_ca_file: str = Field("", description="PEM CA to verify the metadata service's TLS certificate")
    node: str = Field("", description="Node name reported in Stats; empty = this host's name")
    memory_cache_bytes: int = Field(
        512 << 20, ge=0, description="Bytes of the memory tier (files on tmpfs, handed to local jobs by path); 0 = none"
    )
    memory_cache_dir: str = Field(
        "",
        description="tmpfs directory of the memory tier; empty = /dev/shm/silod-cache-<node> "
        "(no memory tier if /dev/shm does not exist)",
    )
    disk_cache_dir: str = Field("silod-cache", description="Directory of the local-disk tier")
    disk_cache_bytes: int = Field(10 << 30, ge=0, description="Bytes of the local-disk tier; 0 = none")
    default_policy: Literal["uniform", "lru", "lrfu-cost"] = Field(
        "lrfu-cost", description="Policy of the shared best-effort cache and of quotas that name none"
    )
    lease_default_s: float = Field(60.0, gt=0, description="Seconds a lease lasts when the caller asks for 0")
    lease_max_s: float = Field(3600.0, gt=0, description="Longest lease a caller may ask for, seconds; at least "
                               "lease_default_s")
    remote_timeout_s: float = Field(30.0, gt=0, description="Seconds one attempt to read a remote object may take")
    remote_retries: int = Field(3, ge=0, le=20, description="Further attempts after a transient remote-read failure")
    remote_concurrency: int = Field(64, ge=1, le=256, description="Remote reads in flight at once")
    prefetch_concurrency: int = Field(
        32, ge=1, le=256, description="Prefetch reads in flight at once per job (part of remote_concurrency)"
    )
    manifest_refresh_s: float = Field(
        30.0, gt=0, description="Seconds between checks of a dataset's manifest version (re-registration)"
    )
    prefetch_lookahead_s: float = Field(
        2.0, gt=0, description="Best-effort prefetch runs this many seconds of a job's measured read rate ahead"
    )
    unallocated_io_trickle_bytes_per_s: float = Field(
        0.0,
        ge=0,
        description="Remote IO rate of a job the plan grants 0 bytes/s while granting IO to others; "
        "0 = none: its misses wait until a plan grants it IO (the storage budget holds)",
    )
    fsync: bool = Field(True, description="fsync disk-tier files before they become visible")
    peer_timeout_s: float = Field(
        1.5, gt=0, le=30,
        description="Seconds a peer cache server (another node of a multi-node job) may take to answer a "
        "miss before it is skipped and the object read from the remote store",
    )
    peer_tls_ca_file: str = Field("", description="PEM CA to verify peer cache servers' TLS certificates")
    lease_socket: str = Field(
        "auto",
        description="Unix socket on which readers on this host may send Lease calls without gRPC's per-call cost "
        "(path; 'auto' = lease.sock in the first tier's directory, which readers see already, or a fresh "
        "directory under the system's temporary directory if that path is too long; 'off' = none)",
    )
    scheduler_address: str = Field(
        "",
        description="HOST:PORT of the AllocationService to follow (plan cache quotas): the allocation service "
        "(silod allocation, as the deployments run it), or the scheduler, or a comma-separated list of the schedulers "
        "that take turns leading (each is watched at once: a standby holds the watch until it leads); empty = "
        "best-effort mode, no watch",
    )

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        from silod.rpc.identifiers import NODE_NAME

        return cls._identifier(value, NODE_NAME)

    @model_validator(mode="after")
    def _lease_default_within_max(self) -> Settings:
        refuse([at_least(self, "lease_max_s", 1, "lease_default_s",
                         "a lease asked for with 0 s would last longer than any a caller may ask for")])
        return self


def cache_config(settings: Settings) -> CacheConfig:
    node = settings.node or socket.gethostname()
    memory_dir = settings.memory_cache_dir
    if not memory_dir and settings.memory_cache_bytes > 0 and os.path.isdir(SHM):
        memory_dir = os.path.join(SHM, f"silod-cache-{node}")
    return CacheConfig(
        node=node,
        memory_dir=memory_dir if settings.memory_cache_bytes > 0 else "",
        memory_bytes=settings.memory_cache_bytes if memory_dir else 0,
        disk_dir=os.path.abspath(settings.disk_cache_dir) if settings.disk_cache_bytes > 0 else "",
        disk_bytes=settings.disk_cache_bytes,
        default_policy=settings.default_policy,
        lease_default_s=settings.lease_default_s,
        lease_max_s=settings.lease_max_s,
        remote_timeout_s=settings.remote_timeout_s,
        remote_retries=settings.remote_retries,
        remote_concurrency=settings.remote_concurrency,
        manifest_refresh_s=settings.manifest_refresh_s,
        prefetch_lookahead_s=settings.prefetch_lookahead_s,
        prefetch_concurrency=settings.prefetch_concurrency,
        unallocated_io_trickle_bytes_per_s=settings.unallocated_io_trickle_bytes_per_s,
        fsync=settings.fsync,
    )


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, core: CacheCore) -> None:
        self.core = core
        self.local_socket = ""  # the local lease socket's path, once it listens

    async def Lease(self, request: cache_pb2.LeaseRequest, context: Any) -> cache_pb2.LeaseResponse:
        return await self.answer_lease(request)

    async def answer_lease(self, request: cache_pb2.LeaseRequest) -> cache_pb2.LeaseResponse:
        """A Lease call, from gRPC or from the local lease socket."""
        if request.release_lease_ids:
            self.core.release_all(request.release_lease_ids)
        if request.prefetch_keys:
            # Queued before this call's own keys are leased: a cold batch's misses may take a
            # while, and the hint is about what comes after them.
            await self.core.prefetch(request.job_id, request.dataset, request.prefetch_keys, field="prefetch_keys")
        lease, served = await self.core.lease(request.job_id, request.dataset, request.keys, request.lease_s)
        response = cache_pb2.LeaseResponse(lease_id=lease.lease_id, expires_at=_timestamp(lease.expires_wall),
                                           local_socket=self.local_socket)
        # Field by field: with the upb runtime, keyword construction of a message costs ~10x more
        # than setting its fields, and this is the hit path (a few µs per sample otherwise).
        add = response.objects.add
        for s in served:
            obj = add()
            obj.key = s.key
            obj.path = s.path
            obj.size_bytes = s.size
            obj.etag = s.etag
            obj.tier = s.tier
        return response

    async def ReleaseLease(
        self, request: cache_pb2.ReleaseLeaseRequest, context: Any
    ) -> cache_pb2.ReleaseLeaseResponse:
        # Unknown or expired ids are fine: releasing is idempotent.
        self.core.release(request.lease_id)
        return cache_pb2.ReleaseLeaseResponse()

    async def Read(self, request: cache_pb2.ReadRequest, context: Any) -> AsyncIterator[cache_pb2.ReadChunk]:
        read = self.core.read_cached if request.cached_only else self.core.read
        async for key, tier, data, etag in read(request.job_id, request.dataset, request.keys):
            if not data:
                yield cache_pb2.ReadChunk(key=key, offset=0, data=b"", last=True, tier=tier, etag=etag)
                continue
            view = memoryview(data)
            for offset in range(0, len(data), CHUNK_BYTES):
                end = min(len(data), offset + CHUNK_BYTES)
                yield cache_pb2.ReadChunk(key=key, offset=offset, data=bytes(view[offset:end]),
                                          last=end == len(data), tier=tier, etag=etag)

    async def Prefetch(self, request: cache_pb2.PrefetchRequest, context: Any) -> cache_pb2.PrefetchResponse:
        objects, nbytes = await self.core.prefetch(request.job_id, request.dataset, request.keys)
        return cache_pb2.PrefetchResponse(objects_queued=objects, bytes_queued=nbytes)

    async def Stats(self, request: cache_pb2.StatsRequest, context: Any) -> cache_pb2.StatsResponse:
        stats = self.core.stats(request.job_id)
        return cache_pb2.StatsResponse(
            node=stats["node"],
            plan_version=stats["plan_version"],
            tiers=[cache_pb2.TierStats(**t) for t in stats["tiers"]],
            jobs=[cache_pb2.JobCacheStats(**j) for j in stats["jobs"]],
            reader_paths=self.reader_paths(),
        )

    def reader_paths(self) -> list[str]:
        paths = self.core.reader_paths()
        if self.local_socket:
            paths.append(os.path.dirname(self.local_socket))
        return sorted(set(paths))


def definition(settings: Settings) -> ServiceDefinition:
    config = cache_config(settings)
    state: dict[str, Any] = {}

    async def load(name: str) -> Any:
        return await load_manifest_async(state["metadata"], name)

    async def probe(name: str) -> int:
        dataset = await state["metadata"].GetDataset(metadata_pb2.GetDatasetRequest(name=name))
        return int(dataset.manifest_version)

    async def cache_address_of(node: str) -> str:
        """A peer's CacheService address when the plan did not carry it (metadata's NodeSpec)."""
        found = await state["metadata"].GetNode(metadata_pb2.GetNodeRequest(node=node))
        return str(found.spec.cache_address)

    def open_peer_channel(address: str) -> Any:
        from silod.rpc.channels import open_channel

        return open_channel(address, token=caller_token(settings), tls_ca_file=settings.peer_tls_ca_file, aio=True,
                            default_timeout_s=settings.peer_timeout_s)

    peers = PeerReader(config.node, open_peer_channel, cache_address_of, timeout_s=settings.peer_timeout_s)
    core = CacheCore(config, load, probe, peers)
    servicer = CacheServicer(core)

    def register(server: grpc.aio.Server) -> None:
        cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, server)

    async def on_start() -> None:
        from silod.rpc.channels import open_channel

        state["channel"] = open_channel(
            settings.metadata_address, token=caller_token(settings), tls_ca_file=settings.metadata_tls_ca_file, aio=True,
            default_timeout_s=60.0,
        )
        state["metadata"] = metadata_pb2_grpc.MetadataServiceStub(state["channel"])
        try:
            await core.start()
        except TierLocked as exc:
            raise StartupError(f"{exc}; give each cache server its own --disk-cache-dir/--memory-cache-dir") from None
        except OSError as exc:
            raise StartupError(f"cache directories: {exc}") from None
        if settings.scheduler_address:
            from cache_server.plan_watch import PlanWatcher
            from worker_agent.node_protocol import WatchTiming

            addresses = [a.strip() for a in settings.scheduler_address.split(",") if a.strip()]
            state["alloc_channels"] = [open_channel(a, token=caller_token(settings), aio=True) for a in addresses]
            state["watcher"] = PlanWatcher(core, config.node, state["alloc_channels"], addresses,
                                           WatchTiming(settings.watch_heartbeat_s, settings.watch_timeout_s))
            state["watcher"].start()
        if settings.lease_socket != "off":
            from cache_server.local_socket import LocalLeaseServer

            directory = None
            if auth_enabled(settings) and settings.metadata_address:  # job credentials, as on gRPC
                from services.runtime.directory import RemoteDirectory

                directory = state["directory"] = RemoteDirectory(
                    settings.metadata_address, caller_token(settings), ttl_s=settings.credential_cache_s,
                    tls_ca_file=getattr(settings, "metadata_tls_ca_file", ""), resolve_any=not settings.auth_token)
            state["local_socket"] = LocalLeaseServer(servicer.answer_lease, core.release, settings.lease_socket,
                                                     token=settings.auth_token, directory=directory,
                                                     beside=core.tiers[0].root if core.tiers else "")
            servicer.local_socket = await state["local_socket"].start()
        _log.info("cache ready", extra={"node": config.node, "capacity_bytes": core.capacity,
                                        "tiers": [t.name for t in core.tiers], "policy": config.default_policy,
                                        "metadata": settings.metadata_address,
                                        "lease_socket": servicer.local_socket or "(none)",
                                        "scheduler": settings.scheduler_address or "(none: best-effort)"})

    async def on_stop() -> None:
        local = state.pop("local_socket", None)
        if local is not None:
            await local.stop()
        directory = state.pop("directory", None)
        if directory is not None:
            await directory.close()
        watcher = state.pop("watcher", None)
        if watcher is not None:
            await watcher.stop()
        await core.stop()
        for channel in [*state.pop("alloc_channels", []), state.pop("channel", None)]:
            if channel is not None:
                await channel.close()

    definition_ = ServiceDefinition(
        name="cache-server",
        service_names=["silod.v1.CacheService"],
        register=register,
        on_start=on_start,
        on_stop=on_stop,
    )
    definition_.core = core  # type: ignore[attr-defined]  # the plan watcher (and tests) call core.apply_quotas
    definition_.state = state  # type: ignore[attr-defined]  # state["watcher"]: the PlanWatcher, if any
    return definition_
