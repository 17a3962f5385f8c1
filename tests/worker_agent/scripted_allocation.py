"""Test double of a peer service: a minimal AllocationService that serves NodePlans the test
scripts and records what agents send (Acks, ReportTasks). The scheduler's real AllocationService
is written elsewhere; this one follows the contract in protos/silod/v1/allocation.proto:

* Watch streams the node's latest plan at once (if any), then every newer one pushed; asked for
  heartbeats (``heartbeat_s``), it sends one first and whenever the stream was quiet that long,
  as the scheduler does (and one first to a watch that waits for leadership, declaring
  ``leader_epoch``); ``frozen`` makes it accept watches and send nothing (a frozen leader),
  ``standby`` holds watches that wait for leadership until it is cleared and refuses the others
  with UNAVAILABLE (a standby scheduler), ``old`` sends no heartbeats and holds nothing (a
  scheduler from before them), ``refusal`` refuses watches with INVALID_ARGUMENT and that text;
* Ack and ReportTasks are recorded; ReportTasks acknowledges every EXITED report it receives
  ("job_id/rank/generation") unless ``ack_exits`` is False.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.v1 import allocation_pb2, allocation_pb2_grpc, plan_pb2
from tests.support.inprocess import InProcessServer


class ScriptedAllocation(allocation_pb2_grpc.AllocationServiceServicer):
    def __init__(self) -> None:
        self.plans: dict[str, list[plan_pb2.NodePlan]] = {}
        self.watch_requests: list[allocation_pb2.WatchPlanRequest] = []
        self.acks: list[allocation_pb2.AckPlanRequest] = []
        self.reports: list[tuple[float, allocation_pb2.ReportTasksRequest]] = []
        self.ack_exits = True
        self.epoch = 0  # bumping it ends every open Watch stream (as a scheduler restart would)
        self.frozen = False  # True: watches get nothing at all, not even heartbeats
        self.standby = False
        self.leader_epoch = 1  # what its heartbeats declare
        self.old = False
        self.refusal = ""
        self._changed: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def drop_watchers(self) -> None:
        async with self._cond():
            self.epoch += 1
            self._cond().notify_all()

    async def push(self, plan: plan_pb2.NodePlan) -> None:
        """Make ``plan`` the node's latest; pushing one again delivers it again to open streams."""
        async with self._cond():
            self.plans.setdefault(plan.node, []).append(plan)
            self._cond().notify_all()

    async def Watch(self, request, context):  # type: ignore[no-untyped-def]
        self.watch_requests.append(request)
        if self.refusal:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refusal)
        if self.standby and (self.old or not request.wait_for_leadership):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler is a standby")
        while self.standby:  # held until it leads
            await asyncio.sleep(0.02)
        sent = 0
        cond = self._cond()
        epoch = self.epoch
        beat = plan_pb2.NodePlan(node=request.node, heartbeat=True, epoch=self.leader_epoch)
        beat_s = 0.0 if self.old else request.heartbeat_s
        if (beat_s > 0 or request.wait_for_leadership and not self.old) and not self.frozen:
            yield beat
        while True:
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait_for(
                        lambda: len(self.plans.get(request.node, [])) > sent or self.epoch != epoch),
                        beat_s or None)
                except asyncio.TimeoutError:
                    pending = [] if self.frozen else [beat]
                else:
                    pending = None
            if pending is not None:
                for message in pending:
                    yield message
                continue
            async with cond:
                if self.epoch != epoch:
                    return
                pending = self.plans[request.node][sent:]
                if sent == 0:
                    pending = pending[-1:]  # a (re)connecting watcher starts from the latest plan
                sent = len(self.plans[request.node])
            for plan in [] if self.frozen else pending:
                yield plan

    async def Ack(self, request, context):  # type: ignore[no-untyped-def]
        self.acks.append(request)
        latest = max((p.version for p in self.plans.get(request.node, [])), default=0)
        return allocation_pb2.AckPlanResponse(latest_version=latest)

    async def ReportTasks(self, request, context):  # type: ignore[no-untyped-def]
        self.reports.append((time.time(), request))
        exits = [
            f"{t.job_id}/{t.rank}/{t.generation}" for t in request.tasks if t.phase == allocation_pb2.TASK_PHASE_EXITED
        ]
        return allocation_pb2.ReportTasksResponse(acknowledged_exits=exits if self.ack_exits else [])


class AllocationServer(InProcessServer):
    def __init__(self) -> None:
        self.servicer = ScriptedAllocation()

        def register(server: Any) -> None:
            allocation_pb2_grpc.add_AllocationServiceServicer_to_server(self.servicer, server)

        super().__init__(
            ServiceDefinition(name="allocation-double", service_names=["silod.v1.AllocationService"], register=register),
            ServiceSettings(log_level="warning"),
            thread_name="allocation-double",
        )

    def push(self, plan: plan_pb2.NodePlan) -> None:
        self.submit(self.servicer.push(plan))

    def drop_watchers(self) -> None:
        self.submit(self.servicer.drop_watchers())

    def task_reports(self) -> list[allocation_pb2.TaskReport]:
        return [t for _, r in list(self.servicer.reports) for t in r.tasks]
