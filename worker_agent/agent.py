"""The worker agent: one node's registration, plans, ranks and reports, put together.

The parts, each in a module of its own:

* registration and heartbeats (here, through :mod:`worker_agent.node_protocol`);
* plans followed and applied (:mod:`worker_agent.plans`), including fast resizes and fencing;
* the task table, launching, stopping and reaping ranks (:mod:`worker_agent.ranks`), with their
  environment (:mod:`worker_agent.launch_env`) and job credentials (:mod:`worker_agent.credentials`);
* how a rank runs, behind one seam (:mod:`worker_agent.runtimes.base`): a process of the
  agent's user (:mod:`worker_agent.runtimes.process`);
* the SDK's calls from inside the ranks (:mod:`worker_agent.rank_calls`).

Reports: ``ReportTasks`` every ``report_s`` and right after any phase change; EXITED tasks are
repeated until the response lists them in ``acknowledged_exits`` ("job_id/rank/generation").

Agent death (SIGKILL, OOM kill, crash): every rank dies with its agent as it would with the
machine (see the runtime), the scheduler requeues the job once the node's heartbeats stop, and
the next agent on the same work_dir stops what the previous one left before applying any plan.

Agent shutdown (SIGTERM): every task gets the checkpoint directive + SIGTERM, SIGKILL after
``stop_grace_s``; tasks stopped this way are not reported EXITED (exit 0 after a checkpoint would
read as job completion); the node's heartbeats stop and the scheduler treats it as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from services.runtime.auth import auth_enabled, caller_token
from services.runtime.settings import ConfigError
from services.runtime.structured_logging import get_logger
from silod.rpc.channels import open_channel
from silod.v1 import allocation_pb2, allocation_pb2_grpc, common_pb2, metadata_pb2, metadata_pb2_grpc, worker_agent_pb2
from worker_agent import capacity, launch_env, node_protocol, nvml, task_metrics
from worker_agent.cache_paths import CachePaths
from worker_agent.credentials import JobCredentials
from worker_agent.gpu_monitor import GpuMonitor
from worker_agent.gpus import GpuTable, resolve_gpu_type
from worker_agent.plans import PlanApplier
from worker_agent.rank_calls import RankCalls
from worker_agent.ranks import Ranks
from worker_agent.runtimes.choose import choose_runtime
from worker_agent.runtimes.process import spawn
from worker_agent.tasks import Task
from worker_agent.warm_start import WarmPool

_log = get_logger("silod.worker_agent")


class Agent:
    def __init__(self, settings: Any, agent_address: str) -> None:
        self.settings = settings
        self.agent_address = agent_address
        # NVML (worker_agent.nvml) gives the GPUs and their health; without it they are emulated.
        session = nvml.open_session(getattr(settings, "nvml_module", ""))
        gpus, model = (session.count, session.model) if session is not None else (settings.gpus, "emulated")
        self._gpu_minors = session.minor_numbers() if session is not None else {}
        self.work_dir = Path(settings.work_dir).resolve()
        (self.work_dir / "jobs").mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = Path(settings.checkpoint_root or self.work_dir / "checkpoints").resolve()
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        self.spec = common_pb2.NodeSpec(
            name=settings.node_name or socket.gethostname(),
            pool=common_pb2.NODE_POOL_INFERENCE if settings.pool == "inference" else common_pb2.NODE_POOL_TRAINING,
            gpus=gpus,
            gpu_model=model,
            gpu_type=resolve_gpu_type(getattr(settings, "gpu_type", ""), model),
            cache_capacity_bytes=settings.cache_capacity_bytes,
            memory_cache_bytes=settings.memory_cache_bytes,
            agent_address=agent_address,
            cache_address=settings.cache_address,
            cpus=getattr(settings, "cpus", 0.0) or capacity.machine_cpus(),
            memory_bytes=getattr(settings, "memory_bytes", 0) or capacity.machine_memory_bytes(),
        )
        self.gpu_table = GpuTable(gpus, self.work_dir / "gpu-table.jsonl")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat_now = asyncio.Event()
        self.gpu_monitor = GpuMonitor(session, self.spec.name, self._gpu_fault_seen) if session is not None else None
        self._report_now = asyncio.Event()
        self._registered = asyncio.Event()
        self._bg: list[asyncio.Task[None]] = []  # heartbeat first, then watch, apply, report
        token = caller_token(settings)  # its node credential, else the cluster token
        self._meta_channel = open_channel(settings.metadata_address, token=token, aio=True)
        self._metadata = metadata_pb2_grpc.MetadataServiceStub(self._meta_channel)
        self._alloc: allocation_pb2_grpc.AllocationServiceStub | None = None
        # Several schedulers (--scheduler-address a,b; --leader-election on them): each is watched at
        # once; the leader streams plans, a standby holds the watch until it leads (node_protocol).
        self._alloc_channels: dict[str, Any] = {}
        self._token = token
        self.schedulers = node_protocol.Schedulers(
            [a.strip() for a in settings.scheduler_address.split(",") if a.strip()], self._use_scheduler)
        if self.schedulers.addresses:
            self._use_scheduler(0)
        # A setting the scheduler refused (the heartbeat too seldom for its node timeout): the
        # process stops and exits 2 naming it (services/runtime/server.py); tests may leave it unset.
        self.on_config_error: Callable[[ConfigError], None] | None = None
        self.runtime = choose_runtime(settings, self.spec.name, self.work_dir, self._warm_pool,
                                      lambda indices: capacity.gpu_devices(indices, self._gpu_minors))
        self.spec.runtime = self.runtime.name
        credentials = JobCredentials(self._metadata, self.spec.name, auth_enabled(settings))
        self.ranks = Ranks(self.spec.name, settings, agent_address, self.runtime, self.gpu_table, credentials,
                           self.work_dir, self.checkpoint_root, self._report_now.set,
                           CachePaths(settings.cache_address, token))
        self.plans = PlanApplier(self.spec.name, self.ranks, settings.checkpoint_deadline_s,
                                 lambda: self._alloc, lambda version: self._report_now.set())
        self.calls = RankCalls(self.ranks)
        task_metrics.track_ranks(self.spec.name, lambda: len(self.ranks.live()))

    def _warm_pool(self, contained: bool) -> WarmPool | None:
        """Warm processes (worker_agent.warm_start) if configured; a contained runtime's start
        from the minimal environment its ranks get."""
        if getattr(self.settings, "warm_processes", 0) <= 0 or not self.settings.scheduler_address:
            return None
        preload = [m.strip() for m in self.settings.warm_preload.split(",") if m.strip()]
        base = launch_env.minimal_base(self.settings.rank_env_passthrough) if contained \
            else launch_env.base_env(self.settings)
        return WarmPool(self.settings.warm_processes, preload, {**base, "PYTHONUNBUFFERED": "1"}, self.work_dir, spawn)

    @property
    def tasks(self) -> dict[str, Task]:
        return self.ranks.tasks

    @property
    def applied_version(self) -> int:
        return self.plans.applied_version

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        _log.info("runtime", extra={"runtime": self.runtime.name, "isolation": self.runtime.describe()})
        await self.runtime.prepare(self.settings.stop_grace_s)
        self._bg.append(asyncio.ensure_future(self._register_and_heartbeat()))
        if self._alloc is not None:
            self._bg.append(asyncio.ensure_future(self._watch_loop()))
            self._bg.append(asyncio.ensure_future(self.plans.run()))
            self._bg.append(asyncio.ensure_future(self._report_loop()))

    async def shutdown(self) -> None:
        """Stop every task (checkpoint directive + SIGTERM, SIGKILL after the grace), report, close."""
        for t in self._bg[1:]:  # keep heartbeating while tasks stop
            t.cancel()
        async with self.plans.lock:
            await self.ranks.stop_all(self.settings.stop_grace_s)
        with contextlib.suppress(Exception):
            await self._report_once(timeout=3)
        for t in self._bg:
            t.cancel()
        for t in self._bg:
            with contextlib.suppress(BaseException):
                await t
        await self.runtime.close()
        await self.ranks.cache_paths.close()
        if self.gpu_monitor is not None:
            await asyncio.to_thread(self.gpu_monitor.close)  # joins the Xid thread
        await self._meta_channel.close()
        for channel in self._alloc_channels.values():
            await channel.close()

    # ---- registration ----------------------------------------------------------------------
    def _gpu_fault_seen(self) -> None:
        """A GPU fault was queued (from the NVML event thread): heartbeat at once, so the
        scheduler moves the job off that GPU without waiting for the next interval."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._heartbeat_now.set)

    async def _heartbeat_request(self) -> metadata_pb2.HeartbeatRequest:
        request = metadata_pb2.HeartbeatRequest(node=self.spec.name, applied_plan_version=self.applied_version)
        if self.gpu_monitor is not None:
            try:
                request.gpu_telemetry.extend(await self.gpu_monitor.sample())
            except Exception:  # noqa: BLE001 - a failing sample must not stop the node's heartbeats
                _log.exception("sampling the GPUs failed")
            request.gpu_faults.extend(self.gpu_monitor.pending_faults())
        return request

    async def _register_and_heartbeat(self) -> None:
        def on_reply(request: metadata_pb2.HeartbeatRequest, node: common_pb2.Node) -> None:
            if self.gpu_monitor is not None:
                self.gpu_monitor.delivered(list(request.gpu_faults))
                self.gpu_monitor.record(node)

        await node_protocol.register_and_heartbeat(
            self._metadata, self.spec, interval_s=self.settings.heartbeat_s, wake=self._heartbeat_now,
            registered=self._registered, request=self._heartbeat_request, log=_log, on_reply=on_reply)

    # ---- plans -----------------------------------------------------------------------------
    def _stub(self, address: str) -> allocation_pb2_grpc.AllocationServiceStub:
        if address not in self._alloc_channels:
            self._alloc_channels[address] = open_channel(address, token=self._token, aio=True)
        return allocation_pb2_grpc.AllocationServiceStub(self._alloc_channels[address])

    def _use_scheduler(self, index: int) -> None:
        """Acks and reports go to this scheduler: the one that declared the newest epoch."""
        self._alloc = self._stub(self.schedulers.addresses[index])

    async def _watch_loop(self) -> None:
        # Plans are acked only once the node exists in the metadata store: the scheduler records
        # an Ack as the node's heartbeat, which fails for a node not registered yet.
        await self._registered.wait()
        s = self.settings
        timing = node_protocol.WatchTiming(getattr(s, "watch_heartbeat_s", 0.0), getattr(s, "watch_timeout_s", 0.0),
                                           s.heartbeat_s)
        try:
            await node_protocol.follow_plans(
                self.spec.name, allocation_pb2.PLAN_COMPONENT_WORKER_AGENT,
                stubs=[self._stub(a) for a in self.schedulers.addresses],
                known_version=lambda: self.applied_version, offer=self.plans.offer,
                on_error=lambda what, detail: _log.info(what, extra={"detail": detail}),
                schedulers=self.schedulers, timing=timing,
                on_follow=lambda address, epoch: _log.info("plan watch following", extra={
                    "scheduler": address, "epoch": epoch}))
        except node_protocol.WatchRefused as exc:
            error = ConfigError(f"heartbeat_s ({s.heartbeat_s:g}): refused by the scheduler at {exc.address}: {exc}")
            _log.error("configuration refused by the scheduler", extra={"detail": str(error)})
            if self.on_config_error is not None:
                self.on_config_error(error)

    # ---- reports ---------------------------------------------------------------------------
    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), self.settings.report_s)
            self._report_now.clear()
            try:
                await self._report_once()
            except grpc.aio.AioRpcError as exc:
                _log.info("report failed", extra={"code": exc.code().name, "detail": exc.details()})
                await asyncio.sleep(min(self.settings.report_s, 1.0))

    async def _report_once(self, timeout: float = 10) -> None:
        if self._alloc is None:
            return
        acknowledged = await node_protocol.report_tasks(self._alloc, self.spec.name, self.applied_version,
                                                        self.ranks.reports(), timeout=timeout)
        self.ranks.acknowledged(acknowledged)

    # ---- what the agent's own service answers ----------------------------------------------
    def node_status(self) -> worker_agent_pb2.NodeStatus:
        return worker_agent_pb2.NodeStatus(
            spec=self.spec,
            applied_plan_version=self.applied_version,
            tasks=[t.status() for t in self.tasks.values()],
            free_gpus=self.gpu_table.free(),
            gpu_telemetry=self.gpu_monitor.telemetry if self.gpu_monitor is not None else [],
            gpu_faults=self.gpu_monitor.faults if self.gpu_monitor is not None else [],
        )
