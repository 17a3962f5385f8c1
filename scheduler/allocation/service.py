"""``silod allocation``: AllocationService (Watch, Ack, ReportTasks) for worker agents and cache
servers, apart from the scheduling rounds. Fed each committed plan once by the leading scheduler
(PlanFeedService.WatchPlans on every --scheduler-address at once, as the nodes watch them: a standby holds the
feed until it leads), it cuts the node parts itself and passes acks and task reports back in
batches (PlanFeedService.Relay). Several may run, each given its share of the nodes (the nodes'
--scheduler-address names theirs). docs/operators.md, "The allocation service"."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from pydantic import Field, field_validator

from services.runtime.server import ServiceDefinition
from services.runtime.settings import ServiceSettings
from silod.rpc.channels import open_channel
from silod.v1 import allocation_pb2_grpc, metadata_pb2_grpc

_log = logging.getLogger("silod.allocation")


class Settings(ServiceSettings):
    metadata_address: str = Field(
        "", validate_default=True, description="HOST:PORT of the metadata service (required): job specs and node "
        "addresses for the node parts, the plan in force at start, the nodes' acked versions")
    scheduler_address: str = Field(
        "", validate_default=True, description="HOST:PORT of the scheduler, or a comma-separated list of the "
        "schedulers that take turns leading (required): each is followed at once, the leader feeds the plans and "
        "takes the acks and task reports")
    name: str = Field("", description="This allocation server's name in the schedulers' logs; empty = the hostname")
    metadata_timeout_s: float = Field(10.0, gt=0, description="Seconds a unary call to the metadata service may take")

    @field_validator("metadata_address", "scheduler_address")
    @classmethod
    def _required(cls, value: str) -> str:
        if not value.strip(","):
            raise ValueError("required: HOST:PORT")
        return value


def definition(settings: Settings) -> ServiceDefinition:
    from scheduler.allocation.follower import PlanFollower
    from scheduler.allocation.relay import Relay
    from scheduler.allocation.servicer import NodeAllocationService
    from scheduler.live.acks import AckForwarder
    from scheduler.live.clients import Clients
    from scheduler.live.plans import PlanStore
    from services.runtime.auth import caller_token
    from worker_agent import node_protocol

    addresses = [a.strip() for a in settings.scheduler_address.split(",") if a.strip()]
    name = settings.name or socket.gethostname()
    clients = Clients(md=None)  # type: ignore[arg-type]  # set once the server's loop runs
    follower = PlanFollower(PlanStore(clients))
    feeds: list[Any] = []
    schedulers = node_protocol.Schedulers(addresses)
    relay = Relay(lambda: feeds[schedulers.index], lambda: follower.leadership.epoch, name)
    acks = AckForwarder(lambda: clients.md, every_s=5.0)
    state: dict[str, Any] = {"channels": []}

    def register(server: Any) -> None:
        allocation_pb2_grpc.add_AllocationServiceServicer_to_server(
            NodeAllocationService(follower, relay, acks), server)

    async def on_start() -> None:
        token = caller_token(settings)
        md = open_channel(settings.metadata_address, token=token, aio=True,
                          default_timeout_s=settings.metadata_timeout_s)
        state["channels"].append(md)
        clients.md = metadata_pb2_grpc.MetadataServiceStub(md)
        for address in addresses:
            channel = open_channel(address, token=token, aio=True)
            state["channels"].append(channel)
            feeds.append(allocation_pb2_grpc.PlanFeedServiceStub(channel))
        await follower.start()
        state["feed"] = asyncio.ensure_future(node_protocol.follow_plans(
            name, 0, stubs=[_FeedStub(feed, name) for feed in feeds], known_version=lambda: follower.latest_version,
            offer=follower.offer, on_error=_log_error, schedulers=schedulers, on_follow=_following))
        _log.info("allocation server ready", extra={"schedulers": addresses, "metadata": settings.metadata_address,
                                                    "plan_version": follower.latest_version})

    async def on_stop() -> None:
        feed = state.pop("feed", None)
        if feed is not None:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
        for flush in (relay.flush(), acks.flush()):
            try:
                await asyncio.wait_for(flush, timeout=5)
            except Exception:  # noqa: BLE001 - stopping: what is not sent, the nodes send again
                pass
        for channel in state["channels"]:
            await channel.close()

    service = ServiceDefinition(name="allocation", service_names=["silod.v1.AllocationService"],
                                register=register, on_start=on_start, on_stop=on_stop)
    service.follower = follower  # type: ignore[attr-defined]  # for in-process tests
    return service


class _FeedStub:
    """PlanFeedService.WatchPlans as node_protocol.follow_plans calls a node's Watch: its loop (every scheduler
    at once, reconnects with backoff, the newest declared epoch picks the leader) is the nodes'."""

    def __init__(self, stub: Any, name: str) -> None:
        self._stub = stub
        self._name = name

    def Watch(self, request: Any) -> Any:  # noqa: N802
        from silod.v1 import allocation_pb2

        return self._stub.WatchPlans(allocation_pb2.WatchPlansRequest(server=self._name,
                                                                   known_version=request.known_version))


_errors_seen: dict[str, str] = {}


def _log_error(what: str, detail: str) -> None:
    if _errors_seen.get(what) != detail:  # each distinct error once
        _errors_seen[what] = detail
        _log.warning(what, extra={"detail": detail})


def _following(address: str, epoch: int) -> None:
    _errors_seen.clear()
    _log.info("following scheduler", extra={"address": address, "epoch": epoch})
