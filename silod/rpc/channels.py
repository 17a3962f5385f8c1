"""Channels to silod services with the same defaults everywhere: retries, token, deadline, TLS."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from silod.rpc.auth import AUTHORIZATION_KEY, bearer_metadata
from silod.rpc.keepalive import CLIENT_KEEPALIVE_OPTIONS
from silod.rpc.limits import MESSAGE_SIZE_OPTIONS

# UNAVAILABLE means the call never reached a servicer (restart, connection refused), so any
# method is safe to retry, not only idempotent ones.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],  # every service and method
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
_RECONNECT_OPTIONS = [
    # gRPC's default reconnect backoff grows to 2 minutes; silod services restart in seconds
    # and a peer that is back must not look down that long.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
]
_OPTIONS = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config", _SERVICE_CONFIG),
    *_RECONNECT_OPTIONS,
    *CLIENT_KEEPALIVE_OPTIONS,
    *MESSAGE_SIZE_OPTIONS,
]


def _metadata_with_token(metadata: Any, token: str) -> list[tuple[str, Any]]:
    pairs = list(metadata or ())
    if token and not any(key == AUTHORIZATION_KEY for key, _ in pairs):
        pairs.append(bearer_metadata(token))
    return pairs


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncDefaults(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call and the default deadline to unary ones.

    Streaming calls get no default deadline: watches and uploads legitimately last long.
    """

    def __init__(self, token: str, default_timeout_s: float) -> None:
        self._token = token
        self._timeout = default_timeout_s

    def _details(self, details: grpc.ClientCallDetails, unary: bool) -> _CallDetails:
        timeout = details.timeout
        if timeout is None and unary:
            timeout = self._timeout
        return _CallDetails(
            details.method,
            timeout,
            _metadata_with_token(details.metadata, self._token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details, True), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details, False), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details, False), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details, False), request_iterator)


class _AioDefaults:
    """The asyncio twin of :class:`_SyncDefaults`.

    grpc.aio files each interceptor under the first call shape it implements only, so it
    takes one object per shape: the four subclasses below.
    """

    def __init__(self, token: str, default_timeout_s: float) -> None:
        self._token = token
        self._timeout = default_timeout_s

    def _details(self, details: grpc.aio.ClientCallDetails, unary: bool) -> grpc.aio.ClientCallDetails:
        timeout = details.timeout
        if timeout is None and unary:
            timeout = self._timeout
        metadata = grpc.aio.Metadata(*_metadata_with_token(details.metadata, self._token))
        return details._replace(timeout=timeout, metadata=metadata)


class _AioUnaryUnary(_AioDefaults, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details, True), request)


class _AioUnaryStream(_AioDefaults, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details, False), request)


class _AioStreamUnary(_AioDefaults, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details, False), request_iterator)


class _AioStreamStream(_AioDefaults, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details, False), request_iterator)


_client_certificate: list[tuple[str, str]] = []  # (cert file, key file) every TLS channel presents


def use_client_certificate(cert_file: str, key_file: str) -> None:
    """Make every TLS channel this process opens from now on present this client certificate (a
    service's tls_client_cert_file/tls_client_key_file: what servers with tls_client_ca_file require)."""
    _client_certificate[:] = [(cert_file, key_file)] if cert_file else []


def open_channel(
    address: str,
    *,
    token: str = "",
    tls_ca_file: str = "",
    aio: bool = False,
    default_timeout_s: float = 10.0,
    own_connection: bool = False,
    tls_cert_file: str = "",
    tls_key_file: str = "",
) -> Any:
    """A ``grpc.Channel`` (or ``grpc.aio.Channel`` if ``aio``) to a silod service.

    Unary calls without a timeout get ``default_timeout_s`` so a hung peer cannot hang the
    caller forever; TLS is used, verified against ``tls_ca_file``, when it is given, presenting
    the client certificate ``tls_cert_file`` (key ``tls_key_file``; default: the process's, see
    :func:`use_client_certificate`), which a server with tls_client_ca_file maps to a principal.
    ``own_connection``: do not share the process's connection to ``address`` with other
    channels. gRPC shares one by default, with its reconnect backoff: a channel opened to
    retry a server that was down would inherit the old connection's backoff and fail at once.
    """
    options = _OPTIONS + [("grpc.use_local_subchannel_pool", 1)] if own_connection else _OPTIONS
    return _open(address, token, tls_ca_file, aio, default_timeout_s, options, (tls_cert_file, tls_key_file))


def _open(
    address: str, token: str, tls_ca_file: str, aio: bool, default_timeout_s: float, options: list[tuple[str, Any]],
    client_certificate: tuple[str, str] = ("", ""),
) -> Any:
    credentials = None
    if tls_ca_file:
        cert_file, key_file = client_certificate if client_certificate[0] else (
            _client_certificate[0] if _client_certificate else ("", ""))
        pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes()) if cert_file else (None, None)
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes(),
                                                   private_key=pair[0], certificate_chain=pair[1])
    if aio:
        interceptors = [
            cls(token, default_timeout_s) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
        ]
        if credentials is not None:
            return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if credentials is not None:
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _SyncDefaults(token, default_timeout_s))


def wait_for_ready(
    address: str, timeout_s: float, *, token: str = "", tls_ca_file: str = "", service: str = ""
) -> None:
    """Poll the health service until ``service`` ("" = the whole server) is SERVING.

    Raises TimeoutError naming the address and the last answer, so a failing start is
    diagnosable from the message alone.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    # No channel-level retries: this loop is the retry, and they would turn the informative
    # "UNAVAILABLE: connection refused" into a bare DEADLINE_EXCEEDED.
    options = [("grpc.enable_retries", 0), *_RECONNECT_OPTIONS]
    with _open(address, token, tls_ca_file, False, timeout_s, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=min(remaining, 1.0))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    what = f"service {service!r}" if service else "server"
    raise TimeoutError(f"{address}: {what} not SERVING after {timeout_s:g}s (last answer: {last})")
