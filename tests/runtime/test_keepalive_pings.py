"""A silod server keeps a connection whose client pings often (keepalive, flow-control probes).

gRPC servers answer a client that pings "too often" with GOAWAY too_many_pings and drop the
connection, and every call on it; silod's servers must not (silod/rpc/keepalive.py). A client
pinging every 200 ms, far more often than the servers' 5 s interval, holds a watch open.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from estimator import service as estimator_service
from services.runtime.server import start_server

EAGER_CLIENT = [
    ("grpc.keepalive_time_ms", 200),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def test_frequent_pings_do_not_close_the_connection() -> None:
    async def scenario() -> tuple[str, float]:
        settings = estimator_service.Settings(log_format="text")
        running = await start_server(estimator_service.definition(settings), settings)
        try:
            async with grpc.aio.insecure_channel(running.address, options=EAGER_CLIENT) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                loop = asyncio.get_running_loop()
                start = loop.time()
                try:
                    # The watch sends SERVING once and nothing more while the server stays
                    # up: a connection with pings and no data, the case the default policy cuts
                    # (after ~3 pings at this rate; 3 s measured with the default strikes).
                    async with asyncio.timeout(4.0):
                        async for _ in watch:
                            pass
                except TimeoutError:
                    return "held", loop.time() - start
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}", loop.time() - start
                return "ended", loop.time() - start
        finally:
            await running.stop(grace=1)

    outcome, seconds = asyncio.run(scenario())
    assert outcome == "held", f"the watch ended after {seconds:.1f} s: {outcome}"
