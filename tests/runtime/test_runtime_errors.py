"""Error mapping and request logging, in-process, for every call shape a servicer can have."""

from __future__ import annotations

import asyncio
import logging
import re

import grpc
import pytest

from silod.rpc.channels import open_channel
from tests.support.servicers import STREAMED_BEFORE_SCRIPT, serving
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc

# script -> (status the caller must see, details it must see)
EXPECTED = {
    "not-found": (grpc.StatusCode.NOT_FOUND, "job_id: no such job"),
    "invalid_spec.name": (grpc.StatusCode.INVALID_ARGUMENT, "spec.name: must not be empty"),
    "abort": (grpc.StatusCode.PERMISSION_DENIED, "aborted by the servicer"),
    "boom": (grpc.StatusCode.INTERNAL, None),  # details checked separately: they carry the request id
}


async def _unary(channel: grpc.aio.Channel, script: str, metadata: tuple = ()) -> None:
    stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
    reply = await stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id=script), metadata=metadata)
    assert reply.action == worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE


async def _server_streaming(channel: grpc.aio.Channel, script: str, metadata: tuple = ()) -> None:
    stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
    received = []
    try:
        async for chunk in stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id=script), metadata=metadata):
            received.append(chunk.rank)
    finally:
        # The messages sent before the failure still reach the caller.
        assert received == list(range(STREAMED_BEFORE_SCRIPT))


async def _client_streaming(channel: grpc.aio.Channel, script: str, metadata: tuple = ()) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(channel)

    async def chunks():  # type: ignore[no-untyped-def]
        yield metadata_pb2.RegisterDatasetRequest(spec=common_pb2.DatasetSpec(name=script))
        for i in range(3):
            yield metadata_pb2.RegisterDatasetRequest(objects=[common_pb2.DatasetObject(key=f"k{i}", size_bytes=1)])

    reply = await stub.RegisterDataset(chunks(), metadata=metadata)
    assert reply.num_objects == 3


SHAPES = {"unary": _unary, "server_streaming": _server_streaming, "client_streaming": _client_streaming}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("script", EXPECTED)
def test_raised_errors_become_statuses(shape: str, script: str) -> None:
    call = SHAPES[shape]
    code, details = EXPECTED[script]

    async def scenario() -> None:
        async with serving() as server, open_channel(server.address, aio=True) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call(channel, script, (("x-request-id", f"req-{shape}"),))
            assert failed.value.code() == code
            if details is not None:
                assert failed.value.details() == details
            else:
                assert failed.value.details() == f"internal error (see server log, request id req-{shape})"
            # Whatever went wrong, the server keeps serving.
            await call(channel, "")

    asyncio.run(scenario())


def test_internal_error_logs_traceback_and_request_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> str:
        async with serving() as server, open_channel(server.address, aio=True) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await _unary(channel, "boom")
            await asyncio.sleep(0.05)  # the status can reach us before the server's log line
            return failed.value.details()

    details = asyncio.run(scenario())
    request_id = re.fullmatch(r"internal error \(see server log, request id (\w+)\)", details).group(1)  # type: ignore[union-attr]
    crash = [r for r in caplog.records if r.getMessage() == "unhandled exception in servicer"]
    assert len(crash) == 1 and crash[0].exc_info is not None
    assert "simulated bug" in str(crash[0].exc_info[1])
    finished = [r for r in caplog.records if r.getMessage() == "rpc finished"]
    assert [(r.method, r.code, r.request_id) for r in finished] == [  # type: ignore[attr-defined]
        ("/silod.v1.WorkerAgentService/GetDirective", "INTERNAL", request_id)
    ]
    assert finished[0].duration_ms >= 0 and finished[0].peer.startswith("ipv4:127.0.0.1:")  # type: ignore[attr-defined]


def test_unimplemented_method_of_base_servicer() -> None:
    async def scenario() -> None:
        async with serving() as server, open_channel(server.address, aio=True) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.GetDataset(metadata_pb2.GetDatasetRequest(name="x"))
            assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "GetDataset" in failed.value.details()

    asyncio.run(scenario())


def test_request_id_is_echoed_in_trailing_metadata() -> None:
    async def scenario() -> None:
        async with serving() as server, open_channel(server.address, aio=True) as channel:
            stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
            call = stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(), metadata=(("x-request-id", "abc123"),))
            await call
            assert dict(await call.trailing_metadata())["x-request-id"] == "abc123"
            generated = stub.GetDirective(worker_agent_pb2.GetDirectiveRequest())
            await generated
            assert re.fullmatch(r"[0-9a-f]{16}", dict(await generated.trailing_metadata())["x-request-id"])

    asyncio.run(scenario())
