"""Graceful shutdown, in-process: health drains first, in-flight calls finish, on_stop runs last."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from silod.rpc.channels import open_channel
from services.runtime.server import start_server
from services.runtime.settings import ServiceSettings
from tests.support.servicers import scripted_definition
from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_stop_flips_health_then_lets_in_flight_call_finish() -> None:
    async def scenario() -> None:
        stopped: list[str] = []
        server = await start_server(scripted_definition(stopped=stopped), ServiceSettings())
        async with open_channel(server.address, aio=True) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="silod.v1.WorkerAgentService")
            )
            assert (await watch.read()).status == SERVING

            agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
            slow = asyncio.ensure_future(agent.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="sleep_1")))
            await asyncio.sleep(0.3)  # the call is now inside the servicer
            started = time.monotonic()
            stopping = asyncio.ensure_future(server.stop(grace=5))

            # Health says NOT_SERVING right away, while the slow call is still running.
            assert (await asyncio.wait_for(watch.read(), 2)).status == NOT_SERVING
            assert not slow.done() and stopped == []
            watch.cancel()  # a watcher that saw NOT_SERVING goes away, as a load balancer would

            reply = await slow
            assert reply.action == worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE
            await stopping
            elapsed = time.monotonic() - started
            # Waited for the call (~0.7 s left of it), not for the whole grace period.
            assert 0.4 < elapsed < 4, elapsed
            assert stopped == ["on_stop"]
            await server.wait_for_termination()  # returns at once: already stopped

            with pytest.raises(grpc.aio.AioRpcError) as after:
                await agent.GetDirective(worker_agent_pb2.GetDirectiveRequest(), timeout=1)
            assert after.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    asyncio.run(scenario())


def test_grace_period_bounds_a_call_that_would_outlive_it() -> None:
    async def scenario() -> None:
        stopped: list[str] = []
        server = await start_server(scripted_definition(stopped=stopped), ServiceSettings())
        async with open_channel(server.address, aio=True) as channel:
            agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
            slow = asyncio.ensure_future(agent.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="sleep_30")))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            # Two concurrent stops are one shutdown.
            await asyncio.gather(server.stop(grace=0.3), server.stop(grace=0.3))
            assert time.monotonic() - started < 3
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await slow
            assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert stopped == ["on_stop"]

    asyncio.run(scenario())


def test_health_reports_serving_for_server_and_each_service() -> None:
    async def scenario() -> None:
        server = await start_server(scripted_definition(), ServiceSettings())
        try:
            async with open_channel(server.address, aio=True) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for name in ("", "silod.v1.WorkerAgentService", "silod.v1.MetadataService"):
                    assert (await health.Check(health_pb2.HealthCheckRequest(service=name))).status == SERVING
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await health.Check(health_pb2.HealthCheckRequest(service="silod.v1.NoSuchService"))
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await server.stop(0)

    asyncio.run(scenario())
