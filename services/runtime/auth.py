"""Shared-bearer-token authentication between silod processes, and the identity a process presents.

The cluster token alone (AuthInterceptor) admits whoever holds it to everything. Services
now run services/runtime/access.py instead, which keeps that token as an admin and adds
per-principal credentials and the access table; these helpers read the presented token (or the
verified TLS client certificate). A node's processes (worker agent, cache server) call with a node
credential of their own instead of the cluster token (:class:`NodeIdentitySettings`).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from pydantic import Field, model_validator

from services.runtime.interceptors import Around, Behavior, wrap_handler
from services.runtime.principals import split_token
from services.runtime.settings import ServiceSettings

HEALTH_PREFIX = "/grpc.health.v1.Health/"
MISSING_BEARER = "missing bearer token"  # the call has no authorization header at all


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> tuple[str, str | None]:
    """(the presented bearer token, None), or ("", why there is none)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return "", MISSING_BEARER
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, presented = value.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return "", "invalid bearer token"
    return presented.strip(), None


def check_bearer(metadata: Iterable[tuple[str, Any]] | None, token: str) -> str | None:
    """Return why the call is refused, or None if it carries ``token``."""
    presented, problem = bearer_token(metadata)
    if problem is not None:
        return problem
    # compare_digest on bytes of both: the time taken must not reveal how much of the token matched.
    if not hmac.compare_digest(presented.encode(), token.encode()):
        return "invalid bearer token"
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the token with UNAUTHENTICATED.

    Health checks are exempt so that orchestrator probes need no secret; reflection is not,
    since it reveals the whole API.
    """

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        problem = check_bearer(handler_call_details.invocation_metadata, self._token)
        if problem is None:
            return handler
        return wrap_handler(handler, _refuse(problem))


def _refuse(problem: str) -> Around:
    async def around(call: Behavior, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    return around


# -- the identity a node process (worker agent, cache server) calls with ----------------------

class NodeIdentitySettings(ServiceSettings):
    """Settings of a process that acts for one node: its node credential, checked at load (a
    well-formed token from one of the two fields, never both). After loading, ``node_credential``
    holds the token whichever way it came."""

    node_credential: str = Field(
        "", description="This node's own credential (kind node, named after the node; `silod admin credential "
        "create node NODE`): sent to other services instead of auth_token, and it turns auth on "
        "here when auth_token is unset. node_credential_file keeps the secret out of the environment")
    node_credential_file: str = Field(
        "", description="File holding node_credential on one line (a Kubernetes secret, a systemd credential); "
        "read once at start")

    @model_validator(mode="after")
    def _read_node_credential(self) -> NodeIdentitySettings:
        where = "node_credential"
        if self.node_credential_file:
            if self.node_credential:
                raise ValueError("node_credential and node_credential_file: set one of them, not both")
            where = "node_credential_file"
            try:
                self.node_credential = Path(self.node_credential_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"node_credential_file: cannot read {self.node_credential_file!r}: "
                                 f"{exc.strerror or exc}") from None
        if self.node_credential and split_token(self.node_credential) is None:
            raise ValueError(f"{where}: not a silod credential (silod_<id>_<secret>); create one with "
                             "`silod admin credential create node NODE`")
        return self


def caller_token(settings: Any) -> str:
    """The token a process sends to other services: its node credential if it has one, else the
    cluster token ("" with auth off)."""
    return str(getattr(settings, "node_credential", "") or getattr(settings, "auth_token", ""))


def auth_enabled(settings: Any) -> bool:
    """Whether the process checks who calls it: it holds the cluster token or a node credential, or
    its callers present certificates (tls_client_ca_file), its own naming it to other services."""
    return bool(getattr(settings, "auth_token", "") or getattr(settings, "node_credential", "")
                or getattr(settings, "tls_client_ca_file", ""))


def certificate_name_of(context: Any) -> tuple[int, str] | None:
    """(kind, name) named by the verified TLS client certificate of a call, if it has one of the
    form services/runtime/principals.certificate_name reads; gRPC fills the auth context only with
    a certificate it verified against tls_client_ca_file."""
    from services.runtime.principals import certificate_name

    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    for value in auth.get("x509_common_name", ()):
        found = certificate_name(value.decode("utf-8", "replace"))
        if found is not None:
            return found
    return None
