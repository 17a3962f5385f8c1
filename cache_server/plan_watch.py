"""The cache server's plan watcher: follows ``AllocationService.Watch`` for this node
(component CACHE_SERVER), applies each new NodePlan's ``cache_quotas`` to the core once, and
Acks it (``ok=False`` with the reason if the core refuses the plan, e.g. quotas above the
node's capacity; the previous quotas then stay in force).

The watch loop and the fencing rule are the worker agent's (worker_agent/node_protocol.py):
reconnect with backoff 0.2 s doubling to 5 s (reset once a plan arrives), ``known_version`` =
the newest version handled, versions not newer than that are ignored. A watch error never
stops the server; each distinct error is logged once.

With several schedulers (``--scheduler-address a,b``: one leads, the others stand by), each is
watched at once, as the worker agent's: a standby holds the watch until it leads, and Acks go to
the scheduler that declared the newest epoch. Opt-in (``watch_heartbeat_s``, ``watch_timeout_s``):
the leader's heartbeats, and its watch opened again once they stop.

Epoch fencing (scheduler leadership): a plan whose ``epoch`` is older than the newest epoch seen
comes from a deposed leader; it is not applied, and is Acked ``ok=False`` naming the reason.

``apply_quotas`` runs on the server's event loop: the core is single-threaded (not thread-safe)
and applying is in-memory bookkeeping plus evictions, so it is not handed to a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from services.runtime.errors import ServiceError
from services.runtime.structured_logging import get_logger
from silod.v1 import allocation_pb2, allocation_pb2_grpc, plan_pb2
from worker_agent import node_protocol

_log = get_logger("silod.cache.plan")

ACK_TIMEOUT_S = 10.0
COMPONENT = allocation_pb2.PLAN_COMPONENT_CACHE_SERVER


class PlanWatcher:
    """Owns one asyncio task; ``start()`` on the server's loop, ``await stop()`` before the core stops."""

    def __init__(self, core: Any, node: str, channels: Any, addresses: Any = (),
                 timing: node_protocol.WatchTiming = node_protocol.WatchTiming()) -> None:
        self.core = core
        self.node = node
        channels = list(channels) if isinstance(channels, (list, tuple)) else [channels]
        self._stubs = [allocation_pb2_grpc.AllocationServiceStub(c) for c in channels]
        self.schedulers = node_protocol.Schedulers(list(addresses) or [str(i) for i in range(len(channels))],
                                                   self._use)
        self.timing = timing
        self.stub = self._stubs[0]
        self.handled_version = int(getattr(core, "plan_version", 0) or 0)  # applied or refused
        self.applied_versions: list[int] = []
        self.refused_versions: list[int] = []
        self.epoch = 0  # the newest leadership epoch seen on a plan
        self._last_error = ""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def _log_error(self, what: str, error: str) -> None:
        text = f"{what}: {error}"
        if text != self._last_error:
            self._last_error = text
            _log.warning(what, extra={"node": self.node, "error": error})

    async def _run(self) -> None:
        await node_protocol.follow_plans(
            self.node, COMPONENT, stubs=self._stubs, known_version=lambda: self.handled_version,
            offer=self._offer, on_error=self._log_error, schedulers=self.schedulers, timing=self.timing,
            on_follow=self._following)

    def _use(self, index: int) -> None:
        self.stub = self._stubs[index]

    def _following(self, address: str, epoch: int) -> None:
        _log.info("plan watch following", extra={"node": self.node, "scheduler": address, "epoch": epoch})

    async def _offer(self, plan: plan_pb2.NodePlan) -> None:
        self._last_error = ""
        await self.handle(plan)

    async def handle(self, plan: plan_pb2.NodePlan) -> None:
        """Apply ``plan`` if it is newer than anything handled, then Ack it."""
        message = node_protocol.epoch_refusal(plan, self.epoch)
        if message:
            _log.warning("plan from an older epoch refused", extra={"version": plan.version, "reason": message})
            self.refused_versions.append(plan.version)
            await self._ack(plan.version, False, message)
            return
        self.epoch = plan.epoch
        if plan.version <= self.handled_version:
            return
        ok, message = True, ""
        try:
            applied = self.core.apply_quotas(list(plan.cache_quotas), plan.version)
            if not applied:  # the core already holds this version or a newer one
                ok, message = True, f"version {plan.version} not newer than applied {self.core.plan_version}"
        except ServiceError as exc:
            ok, message = False, exc.message
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler in the Ack
            _log.exception("applying plan failed", extra={"version": plan.version})
            ok, message = False, f"{type(exc).__name__}: {exc}"
        self.handled_version = plan.version
        (self.applied_versions if ok else self.refused_versions).append(plan.version)
        if not ok:
            _log.warning("plan refused", extra={"version": plan.version, "reason": message})
        await self._ack(plan.version, ok, message)

    async def _ack(self, version: int, ok: bool, message: str) -> None:
        try:
            await self.stub.Ack(
                allocation_pb2.AckPlanRequest(node=self.node, component=COMPONENT, version=version,
                                              ok=ok, message=message),
                timeout=ACK_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            self._log_error("plan ack failed", f"{exc.code().name}: {exc.details()}")
