"""Client helpers against a real in-process server: token, default deadline, retries, readiness."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from silod.rpc.channels import open_channel, wait_for_ready
from tests.support.procs import free_port
from tests.support.servicers import serving
from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc


def _request(script: str = "") -> worker_agent_pb2.GetDirectiveRequest:
    return worker_agent_pb2.GetDirectiveRequest(job_id=script)


def test_token_is_sent_on_unary_and_streaming_calls_sync_and_aio() -> None:
    async def scenario() -> None:
        async with serving(auth_token="s3cret") as server:
            async with open_channel(server.address, aio=True, token="s3cret") as channel:
                agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                await agent.GetDirective(_request())
                chunks = [c async for c in agent.TailLogs(worker_agent_pb2.TailLogsRequest())]
                assert len(chunks) == 2

            def sync_calls() -> None:  # the sync client blocks, so it runs off the server's loop
                with open_channel(server.address, token="s3cret") as channel:
                    agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                    agent.GetDirective(_request())
                    assert len(list(agent.TailLogs(worker_agent_pb2.TailLogsRequest()))) == 2
                with open_channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
                    worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetDirective(_request())
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

            await asyncio.to_thread(sync_calls)

            async with open_channel(server.address, aio=True, token="wrong") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetDirective(_request())
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert refused.value.details() == "invalid bearer token"

    asyncio.run(scenario())


def test_default_deadline_applies_to_unary_calls_only() -> None:
    async def scenario() -> None:
        async with serving() as server:
            async with open_channel(server.address, aio=True, default_timeout_s=0.2) as channel:
                agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await agent.GetDirective(_request("sleep_2"))
                assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - started < 1.5
                # An explicit timeout wins over the default.
                await agent.GetDirective(_request("sleep_0.4"), timeout=5)
                # Streams (watches) are long-lived: no default deadline.
                chunks = [c async for c in agent.TailLogs(worker_agent_pb2.TailLogsRequest(job_id="sleep_0.4"))]
                assert len(chunks) == 2

            def sync_call() -> grpc.StatusCode:
                with open_channel(server.address, default_timeout_s=0.2) as channel:
                    try:
                        worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetDirective(_request("sleep_2"))
                    except grpc.RpcError as exc:
                        return exc.code()
                return grpc.StatusCode.OK

            assert await asyncio.to_thread(sync_call) == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(scenario())


def test_unavailable_is_retried() -> None:
    async def scenario() -> None:
        async with serving() as server, open_channel(server.address, aio=True) as channel:
            agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
            # Fails twice with UNAVAILABLE, then succeeds: within maxAttempts=4.
            reply = await agent.GetDirective(_request("flaky_2"))
            assert reply.action == worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE
            # Fails 5 times: more than the policy allows, so the caller sees it.
            with pytest.raises(grpc.aio.AioRpcError) as gave_up:
                await agent.GetDirective(_request("flaky_5"))
            assert gave_up.value.code() == grpc.StatusCode.UNAVAILABLE
            assert gave_up.value.details() == "flaky attempt 4"

    asyncio.run(scenario())


def test_wait_for_ready() -> None:
    async def scenario() -> None:
        async with serving(auth_token="t") as server:
            await asyncio.to_thread(wait_for_ready, server.address, 5, token="t")

    asyncio.run(scenario())

    address = f"127.0.0.1:{free_port()}"  # nobody listens here
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"{address}: server not SERVING after 0.5s \(last answer: UNAVAILABLE"):
        wait_for_ready(address, 0.5)
    assert time.monotonic() - started < 2
