"""Shared-bearer-token authentication between silod processes.

The cluster token alone (AuthInterceptor) admits whoever holds it to everything. Services
now run services/runtime/access.py instead, which keeps that token as an admin and adds
per-principal credentials and the access table; these helpers read the presented token.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

import grpc

from services.runtime.interceptors import Around, Behavior, wrap_handler

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> tuple[str, str | None]:
    """(the presented bearer token, None), or ("", why there is none)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return "", "missing bearer token"
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
