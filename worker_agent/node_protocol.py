"""A node's side of the control-plane protocol, shared by the worker agent (one node per
process, worker_agent/agent.py and plans.py) and the node fleet (many emulated nodes in one process,
worker_agent/fleet.py), so that the fleet exercises the scheduler and metadata service with
the very calls a real agent makes:

* :func:`register_and_heartbeat`: ``MetadataService.UpsertNode`` once, then ``Heartbeat``
  every interval (or at once when woken), re-registering after NOT_FOUND;
* :func:`follow_plans`: ``AllocationService.Watch`` of one node and component, reconnecting
  with backoff 0.2 s doubling to 5 s (reset once a message arrives) and moving to the next
  scheduler address after a break (one leads; standbys answer UNAVAILABLE, :class:`Schedulers`);
  the leader sends heartbeats, and a watch silent for :class:`WatchTiming`'s ``timeout_s`` is
  abandoned and its scheduler passed over for a while: a frozen or cut-off leader is noticed in
  seconds, not when the HTTP/2 keepalive gives up (15 s);
* :func:`epoch_refusal`: the fencing rule, a plan from an older leadership epoch than the
  newest seen is refused;
* :func:`report_tasks`: one ``ReportTasks`` call, the exits it acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.runtime.settings import ConfigError
from silod.v1 import allocation_pb2, common_pb2, metadata_pb2, plan_pb2

BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 5.0


def epoch_refusal(plan: plan_pb2.NodePlan, newest_epoch: int) -> str:
    """Why ``plan`` must be refused ("" when it may be applied): it comes from a deposed leader."""
    if plan.epoch < newest_epoch:
        return f"plan epoch {plan.epoch} is older than epoch {newest_epoch} already seen (a deposed scheduler)"
    return ""


async def register_and_heartbeat(
    metadata: Any, spec: common_pb2.NodeSpec, *, interval_s: float, wake: asyncio.Event, registered: asyncio.Event,
    request: Callable[[], Awaitable[metadata_pb2.HeartbeatRequest]], log: logging.Logger,
    on_reply: Callable[[metadata_pb2.HeartbeatRequest, common_pb2.Node], None] | None = None,
) -> None:
    """Register ``spec`` and heartbeat forever (cancel to stop). ``registered`` is set once the
    node exists in the store; ``wake`` sends the next heartbeat at once."""
    done = stale_retry = False
    while True:
        try:
            if not done:
                await metadata.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=spec), timeout=5)
                done = True
                registered.set()
                log.info("registered", extra={"node": spec.name, "agent_address": spec.agent_address})
            beat = await request()
            node = await metadata.Heartbeat(beat, timeout=5)
            if on_reply is not None:
                on_reply(beat, node)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and not stale_retry:
                # The scheduler forwards each Ack as a heartbeat with the acked version; one of
                # ours built before that Ack can arrive after it and is refused as a decrease.
                # Our version is now at least the acked one: resend at once. (A restarted agent
                # is refused too until it applied the latest plan, which the watch delivers
                # first; that retry fails the same way and is logged.)
                stale_retry = True
                continue
            log.warning("metadata unreachable", extra={"code": exc.code().name, "detail": exc.details()})
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                done = False
        stale_retry = False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), interval_s)
        wake.clear()


class Schedulers:
    """Which of the node's scheduler addresses its watch uses (one leads; standbys answer
    UNAVAILABLE): the next one after a break. One whose watch went silent (its host frozen or cut
    off, the leader most likely) is passed over for ``avoid_s`` while another is there to try: its
    successor leads elsewhere, and a watch to a silent host would only wait out the silence again.
    ``use(index)`` switches the caller's stubs."""

    def __init__(self, addresses: Sequence[str], use: Callable[[int], None] | None = None) -> None:
        self.addresses = list(addresses)
        self.index = 0
        self._use = use
        self._avoid_until = [0.0] * len(self.addresses)

    @property
    def address(self) -> str:
        return self.addresses[self.index] if self.addresses else ""

    def next(self, avoid_s: float = 0.0) -> None:
        now = time.monotonic()
        if avoid_s > 0:
            self._avoid_until[self.index] = now + avoid_s
        count = len(self.addresses)
        if count < 2:
            return
        order = [(self.index + k) % count for k in range(1, count + 1)]
        ready = [i for i in order if self._avoid_until[i] <= now]
        self.index = ready[0] if ready else min(order, key=lambda i: self._avoid_until[i])
        if self._use is not None:
            self._use(self.index)


@dataclass(frozen=True)
class WatchTiming:
    """``heartbeat_s``: the heartbeat asked of the scheduler (0 = none, as older nodes); a watch
    whose first message does not come within ``timeout_s``, or that has sent heartbeats and then
    stays quiet that long, is abandoned (0 = never: the HTTP/2 keepalive alone, about 15 s).
    ``node_heartbeat_s``: the node's heartbeat interval, which the scheduler checks against its
    node timeout (0 = not said)."""
    heartbeat_s: float = 0.0
    timeout_s: float = 0.0
    node_heartbeat_s: float = 0.0


class WatchRefused(ConfigError):
    """The scheduler refused the watch for one of the node's settings (``node_heartbeat_s``)."""


async def follow_plans(
    node: str, component: int, *, stub: Callable[[], Any], known_version: Callable[[], int],
    offer: Callable[[plan_pb2.NodePlan], Awaitable[None] | None], on_error: Callable[[str, str], None],
    schedulers: Schedulers | None = None, timing: WatchTiming = WatchTiming(),
    on_follow: Callable[[str, int], None] | None = None,
) -> None:
    """Watch ``node``'s plans for ``component`` forever (cancel to stop), handing each plan to
    ``offer`` (heartbeats are not plans: they only prove the stream alive). ``stub()`` is the
    AllocationService stub of the scheduler in use; with several, ``schedulers`` moves to the next
    one after a break. ``on_follow(address, epoch)``: a watch's first message arrived (epoch of the
    scheduler serving it, when it sends heartbeats). Raises :class:`WatchRefused` when the
    scheduler refuses one of the node's settings: a configuration error, not worth retrying."""
    backoff = BACKOFF_INITIAL_S
    loop = asyncio.get_running_loop()
    request = allocation_pb2.WatchPlanRequest(node=node, component=component, heartbeat_s=timing.heartbeat_s,
                                              node_heartbeat_s=timing.node_heartbeat_s)
    while True:
        silent = False
        call = None
        try:
            request.known_version = known_version()
            call = stub().Watch(request)
            silent, backoff = await _read_watch(call, loop, timing, offer, backoff, schedulers, on_follow)
            if silent:
                on_error("plan watch abandoned", f"nothing from the scheduler for {timing.timeout_s:g}s "
                                                 "(frozen, or its host cut off)")
            else:
                on_error("plan watch ended", "stream closed by the allocation service")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and (exc.details() or "").startswith("node_heartbeat_s"):
                raise WatchRefused(exc.details() or "") from None
            on_error("plan watch interrupted", f"{exc.code().name}: {exc.details()}")
        except Exception as exc:  # noqa: BLE001 - a failing handler must not end the node's watch
            on_error("plan watch failed", f"{type(exc).__name__}: {exc}")
        finally:
            if call is not None:
                call.cancel()
        if schedulers is not None and len(schedulers.addresses) > 1:  # the leader may have moved
            schedulers.next(avoid_s=2 * timing.timeout_s if silent else 0.0)
            backoff = min(backoff, 0.5)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


async def _read_watch(call: Any, loop: asyncio.AbstractEventLoop, timing: WatchTiming,
                      offer: Callable[[plan_pb2.NodePlan], Awaitable[None] | None], backoff: float,
                      schedulers: Schedulers | None, on_follow: Callable[[str, int], None] | None,
                      ) -> tuple[bool, float]:
    """Read one watch to its end: (True if abandoned as silent, the backoff). The silence
    deadline runs only while waiting for a message: not while a plan is being applied."""
    first, beating = True, False
    quiet = asyncio.timeout(None)
    try:
        async with quiet:
            while True:
                if timing.timeout_s > 0 and (first or beating):
                    quiet.reschedule(loop.time() + timing.timeout_s)
                plan = await call.read()
                quiet.reschedule(None)
                if plan is grpc.aio.EOF:
                    return False, backoff
                backoff = BACKOFF_INITIAL_S
                if first and on_follow is not None:
                    on_follow(schedulers.address if schedulers is not None else "", plan.epoch if plan.heartbeat else -1)
                first = False
                if plan.heartbeat:
                    beating = True  # this scheduler sends them: its silence means it is gone
                    continue
                handled = offer(plan)
                if handled is not None:
                    await handled
    except TimeoutError:
        if quiet.expired():
            return True, backoff
        raise


async def report_tasks(stub: Any, node: str, applied_version: int, reports: Sequence[allocation_pb2.TaskReport],
                       timeout: float = 10) -> list[str]:
    """One ReportTasks call; the exits the scheduler acknowledged ("job_id/rank/generation"):
    the caller forgets those tasks and repeats the other exited ones."""
    response = await stub.ReportTasks(
        allocation_pb2.ReportTasksRequest(node=node, applied_plan_version=applied_version, tasks=list(reports)),
        timeout=timeout)
    return list(response.acknowledged_exits)
