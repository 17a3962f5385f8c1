"""Which scheduler leads, when several run (``--leader-election``): one lease in the metadata
store (MetadataService.AcquireLeadership), renewed every ``renew_s`` with a ``ttl_s`` lifetime
and taken over by compare-and-set once it has expired, its epoch incrementing at each takeover.

Only the leader runs rounds and commits plans (each stamped with its epoch, which CommitPlan
and the nodes fence on); a standby keeps polling the lease and takes over within ``renew_s`` of
the lease lapsing. The leader counts itself leader only until ``ttl_s`` after it *sent* its last
successful renewal (less a margin), so it stops before any other scheduler can win the lease,
whatever the metadata service's clock says. Without ``--leader-election`` (the default)
``leading`` is always true and the epoch is 0: one scheduler, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc

from scheduler.live.metrics import LEADER, LEADERSHIP_EPOCH
from services.runtime.settings import ConfigError, split_host_port
from silod.v1 import metadata_pb2

_log = logging.getLogger("silod.scheduler")

SAFETY_MARGIN = 0.8  # a leader counts on at most this share of the lease's ttl after a renewal was sent


class Leadership:
    def __init__(self, *, enabled: bool, address: str = "", ttl_s: float = 5.0, renew_s: float = 1.0,
                 holder: str = "") -> None:
        self.enabled = enabled
        self.address = address
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.epoch = 0
        self.leader_address = ""  # the current leader's (this one's when leading)
        self._valid_until = 0.0  # monotonic: leading until then unless renewed
        self._was_leading = False
        self.changed = asyncio.Event()  # set at every change of leading / not leading
        self._until_leading: set[asyncio.Future[None]] = set()  # standbys' held watches (until_leading)
        LEADER.set(0 if enabled else 1)

    @property
    def leading(self) -> bool:
        return not self.enabled or time.monotonic() < self._valid_until

    def describe_leader(self) -> str:
        if self.leader_address:
            return f"this scheduler is a standby; the leader is at {self.leader_address} (epoch {self.epoch})"
        return "this scheduler is a standby; no leader is known yet"

    def deposed(self, why: str) -> None:
        """A commit was refused for our epoch: another scheduler leads now."""
        if self.enabled and self._valid_until:
            _log.warning("leadership lost", extra={"holder": self.holder, "epoch": self.epoch, "reason": why})
            self._valid_until = 0.0
            self._note_change()

    def _note_change(self) -> None:
        now = self.leading
        LEADER.set(1 if now else 0)
        LEADERSHIP_EPOCH.set(self.epoch)
        if now != self._was_leading:
            self._was_leading = now
            self.changed.set()
        if now:
            waiters, self._until_leading = self._until_leading, set()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def until_leading(self) -> None:
        """Return once this scheduler leads (at once if it does): what a standby holds the nodes'
        watches on, so that they hear of its election from it the moment it wins."""
        while not self.leading:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._until_leading.add(waiter)
            try:
                await waiter
            finally:
                self._until_leading.discard(waiter)

    async def acquire_once(self, md) -> bool:  # type: ignore[no-untyped-def]
        """One AcquireLeadership (a renewal while leading); True when this scheduler leads now."""
        sent = time.monotonic()
        try:
            lease = await md.AcquireLeadership(metadata_pb2.AcquireLeadershipRequest(
                holder=self.holder, address=self.address, ttl_s=self.ttl_s), timeout=max(self.renew_s, 0.5))
        except grpc.aio.AioRpcError as exc:
            if self.leading and time.monotonic() + self.renew_s >= self._valid_until:
                _log.warning("leadership renewal failing", extra={"code": exc.code().name, "details": exc.details()})
            self._note_change()
            return self.leading
        self.leader_address = lease.address
        if lease.held:
            if not self._was_leading or lease.epoch != self.epoch:
                _log.info("leadership won", extra={"holder": self.holder, "epoch": lease.epoch, "address": self.address})
            self.epoch = lease.epoch
            self._valid_until = sent + SAFETY_MARGIN * self.ttl_s
        else:
            if self._was_leading:
                _log.warning("leadership lost", extra={"holder": self.holder, "leader": lease.holder,
                                                        "epoch": lease.epoch})
            elif lease.epoch != self.epoch:
                _log.info("standing by: another scheduler leads", extra={
                    "leader": lease.holder, "leader_address": lease.address, "epoch": lease.epoch})
            self.epoch = lease.epoch
            self._valid_until = 0.0
        self._note_change()
        return self.leading

    async def check_supported(self, md) -> None:  # type: ignore[no-untyped-def]
        """At start: a metadata store on SQLite refuses the election (FAILED_PRECONDITION), which is
        a configuration error, not a reason to stand by forever. This first AcquireLeadership may
        win the lease; ``run``'s first renewal then counts as the win."""
        if not self.enabled:
            return
        try:
            await md.AcquireLeadership(metadata_pb2.AcquireLeadershipRequest(
                holder=self.holder, address=self.address, ttl_s=self.ttl_s), timeout=max(self.renew_s, 5.0))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise ConfigError(f"leader_election: {exc.details()}") from None
            # Not reachable yet and the like: run() keeps trying.

    async def step_down(self, md) -> None:  # type: ignore[no-untyped-def]
        """On a clean stop (rounds already stopped): renew for the shortest ttl, so a standby takes
        over within about a second instead of waiting out the lease."""
        if not (self.enabled and self.leading):
            return
        self._valid_until = 0.0
        try:
            await md.AcquireLeadership(metadata_pb2.AcquireLeadershipRequest(
                holder=self.holder, address=self.address, ttl_s=0.5), timeout=1.0)
            _log.info("leadership handed back", extra={"holder": self.holder, "epoch": self.epoch})
        except Exception:  # noqa: BLE001 - the lease then lapses after its ttl
            pass

    async def check_alone(self, md) -> None:  # type: ignore[no-untyped-def]
        """Without --leader-election: say clearly when schedulers with it lead this cluster (this
        one's plans, epoch 0, are then refused by the metadata store)."""
        try:
            lease = await md.GetLeadership(metadata_pb2.GetLeadershipRequest(), timeout=5)
        except Exception:  # noqa: BLE001 - an older metadata service, or not reachable yet: nothing to say
            return
        if lease.epoch > 0:
            _log.error("schedulers with --leader-election lead this cluster (leader %s at %s, epoch %d): this "
                       "scheduler cannot commit plans; start it with --leader-election to stand by",
                       lease.holder, lease.address, lease.epoch)

    async def run(self, md, on_elected: Callable[[], Awaitable[None]]) -> None:  # type: ignore[no-untyped-def]
        """Renew or try to take the lease every renew_s; ``on_elected`` runs at each win."""
        while True:
            was = self._was_leading
            try:
                leading = await self.acquire_once(md)
                if leading and not was:
                    await on_elected()
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("leadership round failed")
            await asyncio.sleep(self.renew_s)


def reachable_address(listen: str) -> tuple[str, str]:
    """(listen with port 0 resolved to a free port now, the HOST:PORT others reach it at): the lease
    must name a concrete address before the server binds (as the worker agent does for itself)."""
    host, port = split_host_port(listen)
    if port == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return listen, (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
