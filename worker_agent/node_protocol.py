"""A node's side of the control-plane protocol, shared by the worker agent (one node per
process, worker_agent/agent.py and plans.py) and the node fleet (many emulated nodes in one process,
worker_agent/fleet.py), so that the fleet exercises the scheduler and metadata service with
the very calls a real agent makes:

* :func:`register_and_heartbeat`: ``MetadataService.UpsertNode`` once, then ``Heartbeat``
  every interval (or at once when woken), re-registering after NOT_FOUND;
* :func:`follow_plans`: ``AllocationService.Watch`` of one node and component, reconnecting
  with backoff 0.2 s doubling to 5 s (reset once a plan arrives) and moving to the next
  scheduler address after a break (one leads; standbys answer UNAVAILABLE);
* :func:`epoch_refusal`: the fencing rule, a plan from an older leadership epoch than the
  newest seen is refused;
* :func:`report_tasks`: one ``ReportTasks`` call, the exits it acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

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


async def follow_plans(
    node: str, component: int, *, stub: Callable[[], Any], known_version: Callable[[], int],
    offer: Callable[[plan_pb2.NodePlan], Awaitable[None] | None], on_error: Callable[[str, str], None],
    next_scheduler: Callable[[], None] | None = None,
) -> None:
    """Watch ``node``'s plans for ``component`` forever (cancel to stop), handing each to
    ``offer``. ``stub()`` is the AllocationService stub of the scheduler in use;
    ``next_scheduler()`` (several schedulers) moves to the next one after a break."""
    backoff = BACKOFF_INITIAL_S
    while True:
        try:
            call = stub().Watch(allocation_pb2.WatchPlanRequest(node=node, component=component,
                                                                known_version=known_version()))
            async for plan in call:
                backoff = BACKOFF_INITIAL_S
                handled = offer(plan)
                if handled is not None:
                    await handled
            on_error("plan watch ended", "stream closed by the allocation service")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            on_error("plan watch interrupted", f"{exc.code().name}: {exc.details()}")
        except Exception as exc:  # noqa: BLE001 - a failing handler must not end the node's watch
            on_error("plan watch failed", f"{type(exc).__name__}: {exc}")
        if next_scheduler is not None:  # the leader may have moved
            next_scheduler()
            backoff = min(backoff, 0.5)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


async def report_tasks(stub: Any, node: str, applied_version: int, reports: Sequence[allocation_pb2.TaskReport],
                       timeout: float = 10) -> list[str]:
    """One ReportTasks call; the exits the scheduler acknowledged ("job_id/rank/generation"):
    the caller forgets those tasks and repeats the other exited ones."""
    response = await stub.ReportTasks(
        allocation_pb2.ReportTasksRequest(node=node, applied_plan_version=applied_version, tasks=list(reports)),
        timeout=timeout)
    return list(response.acknowledged_exits)
