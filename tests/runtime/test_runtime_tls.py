"""TLS: a client trusting the CA gets through, a plaintext client does not, bad settings are named."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest

from silod.rpc.channels import open_channel
from services.runtime.server import start_server
from services.runtime.settings import ConfigError, ServiceSettings
from tests.support.servicers import scripted_definition, serving
from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA); EC keys because RSA is slow to make."""
    tmp = tmp_path_factory.mktemp("tls")
    cert_file, key_file = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key_file), "-out", str(cert_file),
        ],  # fmt: skip
        check=True,
        capture_output=True,
    )
    return cert_file, key_file


def test_tls_client_with_ca_works_and_plaintext_client_fails(cert: tuple[Path, Path]) -> None:
    cert_file, key_file = cert

    async def scenario() -> None:
        async with serving(tls_cert_file=str(cert_file), tls_key_file=str(key_file)) as server:
            async with open_channel(server.address, aio=True, tls_ca_file=str(cert_file)) as channel:
                reply = await worker_agent_pb2_grpc.WorkerAgentServiceStub(channel).GetDirective(
                    worker_agent_pb2.GetDirectiveRequest()
                )
                assert reply.action == worker_agent_pb2.DIRECTIVE_ACTION_CONTINUE
            async with open_channel(server.address, aio=True, default_timeout_s=2) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await worker_agent_pb2_grpc.WorkerAgentServiceStub(plaintext).GetDirective(
                        worker_agent_pb2.GetDirectiveRequest()
                    )
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tls_cert_file": "CERT"}, "tls_key_file: must be set together with tls_cert_file"),
        ({"tls_key_file": "KEY"}, "tls_cert_file: must be set together with tls_key_file"),
        ({"tls_cert_file": "CERT", "tls_key_file": "/nonexistent/key.pem"}, "tls_key_file: cannot read '/nonexistent/key.pem'"),
    ],
)
def test_incomplete_tls_settings_are_named(cert: tuple[Path, Path], settings: dict[str, str], message: str) -> None:
    real = {"CERT": str(cert[0]), "KEY": str(cert[1])}
    settings = {k: real.get(v, v) for k, v in settings.items()}
    with pytest.raises(ConfigError, match=message):
        asyncio.run(start_server(scripted_definition(), ServiceSettings(**settings)))
