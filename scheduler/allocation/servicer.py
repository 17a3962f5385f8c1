"""AllocationService as the allocation server serves it to worker agents and cache servers: the
same contract as the scheduler's (Watch, Ack, ReportTasks), from the plan the leading scheduler fed
(scheduler.allocation.follower), with acks and reports passed to it in batches
(scheduler.allocation.relay). Plans are committed by the scheduler only: CommitPlan is
UNIMPLEMENTED here."""

from __future__ import annotations

from scheduler.allocation.follower import PlanFollower
from scheduler.allocation.relay import Relay
from scheduler.live.acks import AckForwarder
from scheduler.live.node_requests import check_ack, check_report_tasks, counts_as_node_ack
from scheduler.live.watch import watch_node
from services.runtime.errors import NotFound
from silod.v1 import allocation_pb2, allocation_pb2_grpc

WATCH_REFRESH_S = 5.0  # a watch's wake when nothing happens (the feed wakes it at once on a plan)


class NodeAllocationService(allocation_pb2_grpc.AllocationServiceServicer):
    def __init__(self, follower: PlanFollower, relay: Relay, acks: AckForwarder) -> None:
        self.follower = follower
        self.relay = relay
        self.acks = acks  # the nodes' acked versions, written to the store from here

    async def GetLatestPlan(self, request, context):  # noqa: N802
        plan = self.follower.latest
        if plan is None:
            raise NotFound("this allocation server holds no plan yet")
        return plan

    async def Watch(self, request, context):  # noqa: N802
        # scheduler/live/watch.py, on the fed plan: held until a plan is held, then the node's
        # part of every plan that changes it; a node heartbeating too seldom for the leader's
        # node timeout is refused.
        async for node_plan in watch_node(self.follower, request, refresh_s=WATCH_REFRESH_S,
                                          node_timeout_s=lambda: self.follower.node_timeout_s):
            yield node_plan

    async def Ack(self, request, context):  # noqa: N802
        check_ack(request)
        self.relay.ack(request)  # releases free GPUs for the leader's next round: relayed after the answer
        if counts_as_node_ack(request):
            self.acks.add(request.node, request.version)
        return allocation_pb2.AckPlanResponse(latest_version=self.follower.latest_version)

    async def ReportTasks(self, request, context):  # noqa: N802
        check_report_tasks(request)
        acknowledged = await self.relay.report(request)
        return allocation_pb2.ReportTasksResponse(acknowledged_exits=acknowledged)
