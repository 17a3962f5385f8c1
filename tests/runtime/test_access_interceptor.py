"""The access interceptor on its own (services/runtime/access.py), with a directory the test
controls: the principal reaches the handler, a directory that cannot answer is UNAVAILABLE (not
a refusal), a client stream refused is answered cleanly, a method without a row is refused to
admins too, and RemoteDirectory trusts an answer for its TTL only."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.runtime.directory import RemoteDirectory
from services.runtime.errors import Unauthenticated, Unavailable
from services.runtime.principals import JOB, USER, Principal, current_principal
from services.runtime.server import ServiceDefinition
from silod.rpc.channels import open_channel
from silod.v1 import common_pb2, metadata_pb2, metadata_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc
from tests.support.servicers import ScriptedMetadata, scripted_definition, serving

USER_TOKEN = "silod_00000000000000aa_" + "a" * 64
JOB_TOKEN = "silod_00000000000000bb_" + "b" * 64
DOWN_TOKEN = "silod_00000000000000cc_" + "c" * 64


class FakeDirectory:
    async def resolve(self, token: str) -> Principal:
        if token == USER_TOKEN:
            return Principal(USER, "alice", ("vision",))
        if token == JOB_TOKEN:
            return Principal(JOB, "job-1")
        if token == DOWN_TOKEN:
            raise Unavailable("cannot check the credential: the metadata service answered UNAVAILABLE")
        raise Unauthenticated("invalid bearer token")

    async def job_tenant(self, job_id: str) -> str | None:
        return {"job-1": "vision", "job-2": "speech"}.get(job_id)


def _definition(seen: list[Principal | None]) -> ServiceDefinition:
    definition = scripted_definition()

    class Recording(worker_agent_pb2_grpc.WorkerAgentServiceServicer):
        async def GetDirective(self, request, context):  # type: ignore[no-untyped-def]
            seen.append(current_principal.get())
            return worker_agent_pb2.Directive()

    def register_recording(server: grpc.aio.Server) -> None:
        worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(Recording(), server)
        metadata_pb2_grpc.add_MetadataServiceServicer_to_server(ScriptedMetadata(), server)

    definition.register = register_recording
    definition.directory = FakeDirectory()
    return definition


def test_the_principal_reaches_the_handler_and_refusals_are_clean() -> None:
    async def scenario() -> None:
        seen: list[Principal | None] = []
        async with serving(_definition(seen), auth_token="cluster") as server:
            channels = []

            def agent(token: str):  # type: ignore[no-untyped-def]
                channels.append(open_channel(server.address, token=token, aio=True))  # kept: a dropped one closes
                return worker_agent_pb2_grpc.WorkerAgentServiceStub(channels[-1])

            await agent(JOB_TOKEN).GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-1"))
            await agent("cluster").GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-2"))
            assert [p.name for p in seen if p] == ["job-1", "cluster-token"]
            assert current_principal.get() is None, "nothing leaks out of the call"

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent(JOB_TOKEN).GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-2"))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details().startswith("job_id: job 'job-1' may act only for itself")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent(DOWN_TOKEN).GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-1"))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            # A client stream a job may not send: refused before a servicer reads it, and answered.
            async with open_channel(server.address, token=JOB_TOKEN, aio=True) as channel:
                stub = metadata_pb2_grpc.MetadataServiceStub(channel)
                requests = [metadata_pb2.RegisterDatasetRequest(spec=common_pb2.DatasetSpec(name="d"))] * 50
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.RegisterDataset(iter(requests))
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert len(seen) == 2
            for channel in channels:
                await channel.close()

    asyncio.run(scenario())


def test_a_method_without_a_row_is_refused_even_to_an_admin() -> None:
    from services.runtime.access import AccessInterceptor

    async def scenario() -> None:
        interceptor = AccessInterceptor("cluster", None, rules={})
        refusal = await interceptor._authorize("/silod.v1.X/Y", None, Principal(1, "cluster-token"), object())
        assert refusal is not None and "not in the access table" in refusal[0]

    asyncio.run(scenario())


def test_remote_directory_trusts_an_answer_for_its_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    from silod.v1 import access_pb2

    answers = []

    class Stub:
        async def ResolveCredential(self, request):  # type: ignore[no-untyped-def]
            answers.append(request.token)
            if len(answers) > 1:
                raise _Revoked()
            return access_pb2.ResolveCredentialResponse(
                principal=access_pb2.Principal(kind=USER, name="alice"), credential_id="00000000000000aa")

    class _Revoked(grpc.aio.AioRpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                             "invalid bearer token")

    now = [100.0]
    monkeypatch.setattr("services.runtime.directory.time.monotonic", lambda: now[0])
    directory = RemoteDirectory("127.0.0.1:1", "cluster", ttl_s=5)
    monkeypatch.setattr(directory, "_stub", lambda: Stub())

    async def scenario() -> None:
        with pytest.raises(Unauthenticated):
            await directory.resolve("not-a-credential")
        assert answers == [], "a token that is no credential is refused without asking"
        assert (await directory.resolve(USER_TOKEN)).name == "alice"
        now[0] += 4.9
        assert (await directory.resolve(USER_TOKEN)).name == "alice"
        assert len(answers) == 1
        now[0] += 0.2
        with pytest.raises(Unauthenticated):
            await directory.resolve(USER_TOKEN)

    asyncio.run(scenario())
