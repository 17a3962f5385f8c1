"""AllocationService.Watch: one node's part of every plan that changes it, from the leader only.

* A standby answers UNAVAILABLE naming the leader (:func:`require_leader`), or, when the node
  asks (``wait_for_leadership``: nodes watch every scheduler at once), holds the watch until it
  leads. A leader frozen or cut off resets nothing and says nothing, so its nodes cannot tell it
  from one with nothing to say; they need not: the moment a standby wins the lease, the watches it
  held get a heartbeat with its epoch and the plan in force, and the nodes follow it
  (worker_agent/node_protocol.py). A held watch costs the standby nothing while it waits.
* A leader that loses the lease ends its watches at its next wake (a heartbeat, or ``refresh_s``).
* A node that asks for heartbeats (``heartbeat_s``, at least 0.1 s; or waits for leadership) gets
  one first, carrying the serving leader's epoch; with ``heartbeat_s``, also whenever its stream
  was quiet that long, which a node may use to leave a watch gone silent (opt-in: each heartbeat
  costs the scheduler a streamed message, tens of microseconds of its one core).
* A worker agent says how often it heartbeats to the metadata service (``node_heartbeat_s``); a
  node timeout under :data:`NODE_TIMEOUT_PER_HEARTBEAT` of those would count the node lost
  between two heartbeats (its jobs requeued, over and over), so the watch is refused naming both
  settings and the agent exits with a configuration error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from scheduler.live import convert
from services.runtime import downstream
from services.runtime.errors import InvalidArgument, Unavailable
from silod.v1 import allocation_pb2, plan_pb2

WATCH_REFRESH_AGE_S = 1.0  # a Watch accepts a read of the plan in force this old (shared by all watchers)
MIN_HEARTBEAT_S = 0.1  # the most often a node may ask for heartbeats
NODE_TIMEOUT_PER_HEARTBEAT = 3  # node_timeout_s must be at least this many node heartbeat intervals


def require_leader(core: Any) -> None:
    """With --leader-election, the nodes follow the leader only: a standby answers UNAVAILABLE
    naming the leader's address, and the node tries its next --scheduler-address."""
    leadership = getattr(core, "leadership", None)
    if leadership is not None and not leadership.leading:
        raise Unavailable(leadership.describe_leader())


def node_heartbeat_problem(node_heartbeat_s: float, node_timeout_s: float) -> str:
    """Why a node heartbeating every ``node_heartbeat_s`` cannot be served with this node timeout
    ("" when it can, or when the node did not say)."""
    if node_heartbeat_s > 0 and node_timeout_s < NODE_TIMEOUT_PER_HEARTBEAT * node_heartbeat_s:
        return (f"the scheduler's node_timeout_s ({node_timeout_s:g}) must be at least "
                f"{NODE_TIMEOUT_PER_HEARTBEAT}x the node's heartbeat_s ({node_heartbeat_s:g}), or the node counts "
                "as lost between two heartbeats and its jobs are requeued over and over: lower heartbeat_s on "
                "the node or raise node_timeout_s on the scheduler")
    return ""


def check_watch(request: allocation_pb2.WatchPlanRequest, node_timeout_s: float | None) -> float:
    """Refuse what cannot be served; the heartbeat interval asked for (0 = none).
    ``node_timeout_s``: the leader's; None while it is not known here (not checked then)."""
    if not request.node:
        raise InvalidArgument("required", field="node")
    if request.heartbeat_s < 0 or request.node_heartbeat_s < 0:
        raise InvalidArgument("must be >= 0", field="heartbeat_s" if request.heartbeat_s < 0 else "node_heartbeat_s")
    problem = node_heartbeat_problem(request.node_heartbeat_s, node_timeout_s) if node_timeout_s is not None else ""
    if problem:
        raise InvalidArgument(problem, field="node_heartbeat_s")
    return max(request.heartbeat_s, MIN_HEARTBEAT_S) if request.heartbeat_s > 0 else 0.0


def as_of(node_plan: plan_pb2.NodePlan, plan: plan_pb2.AllocationPlan) -> plan_pb2.NodePlan:
    """``node_plan`` sent as part of ``plan``: a part kept from the cut of an earlier plan is
    copied with ``plan``'s version and epoch (the one kept is shared by its node's watchers)."""
    if node_plan.version == plan.version and node_plan.epoch == plan.epoch:
        return node_plan
    sent = plan_pb2.NodePlan()
    sent.CopyFrom(node_plan)
    sent.version, sent.epoch = plan.version, plan.epoch
    return sent


def _heartbeat(core: Any, node: str) -> plan_pb2.NodePlan:
    leadership = getattr(core, "leadership", None)
    return plan_pb2.NodePlan(node=node, heartbeat=True, epoch=leadership.epoch if leadership is not None else 0)


async def watch_node(core: Any, request: allocation_pb2.WatchPlanRequest, *, refresh_s: float,
                     node_timeout_s: float | Callable[[], float | None]) -> AsyncIterator[plan_pb2.NodePlan]:
    """The stream of one node's Watch (see the module's docstring). ``node_timeout_s``: the
    leader's, or how to read it where it may not be known yet (an allocation server before a
    scheduler fed it): the node's heartbeat is checked against it once it is known."""
    timeout_now = node_timeout_s if callable(node_timeout_s) else (lambda: node_timeout_s)
    known_timeout = timeout_now()
    beat_s = check_watch(request, known_timeout)
    leadership = getattr(core, "leadership", None)
    if request.wait_for_leadership and leadership is not None:
        await leadership.until_leading()  # a standby: held until it wins the lease
    require_leader(core)
    if beat_s or request.wait_for_leadership:
        yield _heartbeat(core, request.node)  # at once: the node knows which leader serves it, and its epoch
    # Watchers share their reads of the store (max_age_s): a thousand nodes reconnecting
    # after a restart, or waking together, make one GetLatestPlan, not a thousand.
    await downstream.forward(core.refresh_latest(max_age_s=WATCH_REFRESH_AGE_S), "metadata GetLatestPlan", None)
    # A node is sent the plans that change its part only (the first one always): a round
    # that moves a few jobs on a thousand nodes then costs a few streams' messages, acks and
    # task reports, not a thousand. Its acked version is so the newest plan that changed it.
    loop = asyncio.get_running_loop()
    sent, shown = 0, None
    refresh_at = loop.time() + refresh_s
    beat_at = loop.time() + beat_s
    while True:
        plan = core.latest
        if plan is not None and plan.version > sent:
            node_plan = await core.node_plan(plan, request.node)
            # A part no plan changed since an earlier one is the same object (scheduler.live.node_views).
            if node_plan is not shown and (shown is None or not convert.same_node_part(node_plan, shown)):
                shown = node_plan
                yield as_of(node_plan, plan)
                beat_at = loop.time() + beat_s
            sent = plan.version
        now = loop.time()
        await core.wait_newer(sent, max(0.0, min(refresh_at, beat_at) - now) if beat_s else refresh_s, request.node)
        require_leader(core)  # deposed: the watcher moves to the new leader
        if known_timeout is None and (known_timeout := timeout_now()) is not None:
            check_watch(request, known_timeout)  # declared since the node connected: refused now if too slow
        now = loop.time()
        if core.latest is not None and core.latest.version > sent:
            continue
        if not beat_s or now >= refresh_at:
            await downstream.forward(core.refresh_latest(max_age_s=WATCH_REFRESH_AGE_S), "metadata GetLatestPlan",
                                     None)  # committed by someone else
            refresh_at = now + refresh_s
            if core.latest is not None and core.latest.version > sent:
                continue
        if beat_s and loop.time() >= beat_at:
            yield _heartbeat(core, request.node)
            beat_at = loop.time() + beat_s
