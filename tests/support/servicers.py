"""A scripted test service: the request says how the servicer should behave or fail.

It implements real silod.v1 methods of every call shape the runtime must handle:
WorkerAgentService.GetDirective (unary), WorkerAgentService.TailLogs (server streaming) and
MetadataService.RegisterDataset (client streaming). The script is the job id or dataset name
(so it is a valid identifier: the runtime refuses any other before a servicer runs):

    ""              succeed
    "sleep_SECONDS" succeed after sleeping
    "not-found"     raise errors.NotFound(field="job_id")
    "invalid_FIELD" raise errors.InvalidArgument(field=FIELD)
    "boom"          raise RuntimeError (a bug)
    "abort"         context.abort(PERMISSION_DENIED) directly
    "flaky_N"       raise errors.Unavailable the first N times (per servicer), then succeed
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.runtime import errors
from services.runtime.server import RunningServer, ServiceDefinition, start_server
from services.runtime.settings import ServiceSettings
from silod.v1 import common_pb2, metadata_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc

STREAMED_BEFORE_SCRIPT = 2  # TailLogs sends this many chunks before acting out its script


async def act(script: str, context: grpc.aio.ServicerContext, attempts: Counter[str] | None = None) -> None:
    kind, _, arg = script.partition("_")
    if kind == "flaky":
        assert attempts is not None
        attempts[script] += 1
        if attempts[script] <= int(arg):
            raise errors.Unavailable(f"flaky attempt {attempts[script]}")
    elif kind == "sleep":
        await asyncio.sleep(float(arg))
    elif kind == "not-found":
        raise errors.NotFound("no such job", field="job_id")
    elif kind == "invalid":
        raise errors.InvalidArgument("must not be empty", field=arg)
    elif kind == "boom":
        raise RuntimeError("simulated bug")
    elif kind == "abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "aborted by the servicer")
    elif kind:
        raise AssertionError(f"unknown script {script!r}")


class ScriptedWorkerAgent(worker_agent_pb2_grpc.WorkerAgentServiceServicer):
    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()

    async def GetDirective(self, request, context):  # type: ignore[no-untyped-def]
        await act(request.job_id, context, self.attempts)
        return worker_agent_pb2.Directive(action=worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE)

    async def TailLogs(self, request, context) -> AsyncIterator[worker_agent_pb2.LogChunk]:  # type: ignore[no-untyped-def]
        for rank in range(STREAMED_BEFORE_SCRIPT):
            yield worker_agent_pb2.LogChunk(rank=rank, data=b"line\n")
        await act(request.job_id, context)


class ScriptedMetadata(metadata_pb2_grpc.MetadataServiceServicer):
    async def RegisterDataset(self, request_iterator, context):  # type: ignore[no-untyped-def]
        name, objects = "", 0
        async for chunk in request_iterator:
            name = name or chunk.spec.name
            objects += len(chunk.objects)
        await act(name, context)
        return common_pb2.Dataset(spec=common_pb2.DatasetSpec(name=name), num_objects=objects)


def scripted_definition(name: str = "scripted", stopped: list[str] | None = None) -> ServiceDefinition:
    """The scripted service; ``stopped`` gets "on_stop" appended when on_stop runs."""

    def register(server: grpc.aio.Server) -> None:
        worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(ScriptedWorkerAgent(), server)
        metadata_pb2_grpc.add_MetadataServiceServicer_to_server(ScriptedMetadata(), server)

    async def on_stop() -> None:
        if stopped is not None:
            stopped.append("on_stop")

    return ServiceDefinition(
        name=name,
        service_names=["silod.v1.WorkerAgentService", "silod.v1.MetadataService"],
        register=register,
        on_stop=on_stop,
    )


@contextlib.asynccontextmanager
async def serving(definition: ServiceDefinition | None = None, **settings: Any) -> AsyncIterator[RunningServer]:
    """An in-process server on a free loopback port; ``settings`` are ServiceSettings fields."""
    server = await start_server(definition or scripted_definition(), ServiceSettings(**settings))
    try:
        yield server
    finally:
        await server.stop(0)


def _main(argv: list[str]) -> int:
    """``python -m tests.support.servicers ON_START [SETTINGS...]``: run() the scripted service as a
    process whose on_start "hangs" or "fails", to test startup paths no real service has yet."""
    import sys

    from services.runtime.server import run

    behaviour, *flags = argv

    async def on_start() -> None:
        if behaviour == "fail":
            raise RuntimeError("database unreachable")
        if behaviour == "hang":
            print("on_start: hanging", file=sys.stderr, flush=True)  # lets a test signal us now
            await asyncio.Event().wait()

    definition = scripted_definition()
    definition.on_start = on_start
    settings = ServiceSettings(**dict(flag.removeprefix("--").replace("-", "_").split("=", 1) for flag in flags))
    return run(definition, settings)


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
