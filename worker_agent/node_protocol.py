"""A node's side of the control-plane protocol, shared by the worker agent (one node per
process, worker_agent/agent.py and plans.py) and the node fleet (many emulated nodes in one process,
worker_agent/fleet.py), so that the fleet exercises the scheduler and metadata service with
the very calls a real agent makes:

* :func:`register_and_heartbeat`: ``MetadataService.UpsertNode`` once, then ``Heartbeat``
  every interval (or at once when woken), re-registering after NOT_FOUND;
* :func:`follow_plans`: ``AllocationService.Watch`` of one node and component on every
  scheduler address at once, each reconnecting with backoff 0.2 s doubling to 5 s (reset once a
  message arrives): the leader streams plans, a standby holds the watch until it wins the lease
  and then declares its epoch, and acks and reports go to whichever declared the newest
  (:class:`Schedulers`). A leader gone silent (frozen, its host cut off) is left the moment its
  successor is elected, not when the HTTP/2 keepalive gives up (15 s); heartbeats on the
  leader's watch (:class:`WatchTiming`) are an opt-in way to leave a silent one sooner;
* :func:`epoch_refusal`: the fencing rule, a plan from an older leadership epoch than the
  newest seen is refused;
* :func:`report_tasks`: one ``ReportTasks`` call, the exits it acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
    """The node's scheduler addresses, all watched at once: the leader streams plans, a standby
    holds the watch until it wins the lease and then says so first (a heartbeat carrying its
    epoch). The leader is the one that declared the newest epoch; acks and reports go to it
    (``use(index)`` switches the caller's stubs). A leader gone silent (frozen, its host cut
    off) needs no noticing: its successor's heartbeat on the held watch moves the node."""

    def __init__(self, addresses: Sequence[str], use: Callable[[int], None] | None = None) -> None:
        self.addresses = list(addresses)
        self.index = 0
        self._use = use
        self._serving = [-1] * len(self.addresses)  # the epoch each declared; -1: its watch is not serving

    @property
    def address(self) -> str:
        return self.addresses[self.index] if self.addresses else ""

    def serving(self, index: int, epoch: int) -> bool:
        """The scheduler at ``index`` serves at ``epoch``; True when it is (now) the leader."""
        self._serving[index] = epoch
        if index != self.index and epoch >= self._serving[self.index]:
            self.index = index
            if self._use is not None:
                self._use(index)
        return index == self.index

    def ended(self, index: int) -> None:
        self._serving[index] = -1


@dataclass(frozen=True)
class WatchTiming:
    """``heartbeat_s``: heartbeats asked of the leader whenever a watch was quiet that long, and
    ``timeout_s``: a watch that sent heartbeats and then stays quiet that long is abandoned and
    opened again (both 0 = off, the default: a new leader tells the nodes itself, and the HTTP/2
    keepalive closes a dead connection within 15 s). ``node_heartbeat_s``: the node's heartbeat
    interval, which the scheduler checks against its node timeout (0 = not said)."""
    heartbeat_s: float = 0.0
    timeout_s: float = 0.0
    node_heartbeat_s: float = 0.0


class WatchRefused(ConfigError):
    """The scheduler at ``address`` refused the watch for one of the node's settings
    (``node_heartbeat_s``); the message is its refusal, without the field's name."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message.removeprefix("node_heartbeat_s: "))
        self.address = address


async def follow_plans(
    node: str, component: int, *, stubs: Sequence[Any], known_version: Callable[[], int],
    offer: Callable[[plan_pb2.NodePlan], Awaitable[None] | None], on_error: Callable[[str, str], None],
    schedulers: Schedulers | None = None, timing: WatchTiming = WatchTiming(),
    on_follow: Callable[[str, int], None] | None = None,
) -> None:
    """Watch ``node``'s plans for ``component`` on every scheduler at once (``stubs``, in the order
    of ``schedulers.addresses``) forever (cancel to stop), handing each plan to ``offer`` (the
    caller fences epochs and ignores versions it has: the leader streams plans, a standby holds
    the watch until it leads). ``on_follow(address, epoch)``: a scheduler's watch started serving
    (the epoch it declared; a plan's for a scheduler from before the heartbeats). Raises
    :class:`WatchRefused` when a scheduler refuses one of the node's settings: a configuration
    error, not worth retrying."""
    schedulers = schedulers if schedulers is not None else Schedulers([str(i) for i in range(len(stubs))])
    watches = [asyncio.ensure_future(_follow_one(
        i, stub, allocation_pb2.WatchPlanRequest(
            node=node, component=component, heartbeat_s=timing.heartbeat_s if timing.timeout_s > 0 else 0.0,
            node_heartbeat_s=timing.node_heartbeat_s, wait_for_leadership=True),
        known_version, offer, on_error, schedulers, timing, on_follow)) for i, stub in enumerate(stubs)]
    try:
        done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_EXCEPTION)
        for watch in done:
            watch.result()  # WatchRefused
    finally:
        for watch in watches:
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)


async def _follow_one(index: int, stub: Any, request: allocation_pb2.WatchPlanRequest, known_version: Callable[[], int],
                      offer: Callable[[plan_pb2.NodePlan], Awaitable[None] | None], on_error: Callable[[str, str], None],
                      schedulers: Schedulers, timing: WatchTiming, on_follow: Callable[[str, int], None] | None,
                      ) -> None:
    """One scheduler's watch, opened again after every break with backoff 0.2 s doubling to 5 s
    (reset once a message arrives)."""
    backoff = BACKOFF_INITIAL_S
    loop = asyncio.get_running_loop()
    while True:
        call = None
        try:
            request.known_version = known_version()
            call = stub.Watch(request)
            silent, backoff = await _read_watch(index, call, loop, timing, offer, backoff, schedulers, on_follow)
            if silent:
                on_error("plan watch abandoned", f"no heartbeat from {schedulers.addresses[index]} for "
                                                 f"{timing.timeout_s:g}s (frozen, or its host cut off)")
            else:
                on_error("plan watch ended", "stream closed by the allocation service")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and (exc.details() or "").startswith("node_heartbeat_s"):
                raise WatchRefused(exc.details() or "", schedulers.addresses[index]) from None
            on_error("plan watch interrupted", f"{exc.code().name}: {exc.details()}")
        except Exception as exc:  # noqa: BLE001 - a failing handler must not end the node's watch
            on_error("plan watch failed", f"{type(exc).__name__}: {exc}")
        finally:
            schedulers.ended(index)
            if call is not None:
                call.cancel()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


async def _read_watch(index: int, call: Any, loop: asyncio.AbstractEventLoop, timing: WatchTiming,
                      offer: Callable[[plan_pb2.NodePlan], Awaitable[None] | None], backoff: float,
                      schedulers: Schedulers, on_follow: Callable[[str, int], None] | None,
                      ) -> tuple[bool, float]:
    """Read one watch to its end: (True if abandoned as silent, the backoff). The silence
    deadline runs only once the scheduler has sent heartbeats (a standby holding the watch is
    silent by design), and only while waiting for a message, not while a plan is applied."""
    first, beating = True, False
    quiet = asyncio.timeout(None)
    try:
        async with quiet:
            while True:
                if timing.timeout_s > 0 and beating:
                    quiet.reschedule(loop.time() + timing.timeout_s)
                plan = await call.read()
                quiet.reschedule(None)
                if plan is grpc.aio.EOF:
                    return False, backoff
                backoff = BACKOFF_INITIAL_S
                if first:  # the scheduler leads and serves this watch: a heartbeat with its epoch, or a plan
                    schedulers.serving(index, plan.epoch)
                    if on_follow is not None:
                        on_follow(schedulers.addresses[index], plan.epoch)
                    first = False
                if plan.heartbeat:  # with heartbeats asked for, this scheduler's silence now means it is gone
                    beating = timing.heartbeat_s > 0 and timing.timeout_s > 0
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
