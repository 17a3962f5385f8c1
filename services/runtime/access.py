"""Authentication to a principal and authorization by the access table, in one interceptor.

A call presents ``authorization: Bearer <token>``. The cluster token (settings auth_token) is
an admin, as it always was; any other token is a credential the directory resolves
(services/runtime/directory.py). The principal's row of services/runtime/access_rules.py then
decides: UNAUTHENTICATED for no or a bad token, PERMISSION_DENIED (naming the request field)
for a principal the table does not admit. The servicer runs only when admitted, with
:data:`~services.runtime.principals.current_principal` set.

With TLS client certificates (tls_client_ca_file), a call without a bearer token stands for the
principal its verified certificate names (services/runtime/principals.certificate_name).

A client stream (RegisterDataset) is decided on its first message, which says what the call is
about (the dataset, its tenant, whether it replaces one): when the caller's check reads the
request, the interceptor reads that message, checks it (a check may fill in a field, as for a
unary request), and hands the servicer the same stream, that message first (:class:`_FirstMessage`).
This keeps the decision here, in the one table, rather than in each servicer that reads a stream,
where it could be forgotten. An empty stream is admitted: there is nothing to act on, and the
servicer refuses it as it would anyone's.

Installed by services/runtime/server.py whenever auth_token or a node credential is set; without
them a process serves everyone, as a single-machine cluster always did.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.runtime.access_rules import RULES, Rule
from services.runtime.audit import note_principal
from services.runtime.auth import bearer_token
from services.runtime.directory import Directory
from services.runtime.errors import ServiceError, Unauthenticated
from services.runtime.interceptors import Behavior, _drain, wrap_handler
from services.runtime.principals import ADMIN, CLUSTER_ADMIN, Principal, current_principal
from services.runtime.auth import MISSING_BEARER, certificate_name_of
from silod.rpc.errors import DETAILS_KEY, FieldViolation, status_details, summary


class AccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, cluster_token: str, directory: Directory | None, rules: dict[str, Rule] = RULES,
                 client_certificates: bool = False) -> None:
        self._cluster_token = cluster_token.encode()  # b"": this process does not hold it (a node's)
        self._directory = directory
        self._rules = rules
        self._client_certificates = client_certificates  # TLS with tls_client_ca_file: certificates name principals

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        rule = self._rules.get(method)
        if rule is not None and rule.public:
            return handler
        token, problem = bearer_token(handler_call_details.invocation_metadata)
        return wrap_handler(handler, functools.partial(self._guard, method, rule, token, problem))

    async def _guard(self, method: str, rule: Rule | None, token: str, problem: str | None,
                     call: Behavior, request: Any, context: grpc.aio.ServicerContext) -> Any:
        certified = None
        if problem == MISSING_BEARER and self._client_certificates:  # a malformed header is not "none"
            certified = certificate_name_of(context)
        if problem is not None and certified is None:
            return await _refuse(context, request, grpc.StatusCode.UNAUTHENTICATED, problem)
        try:
            principal = await (self._certified(*certified) if certified is not None else self._authenticate(token))
            note_principal(principal)  # the audit log's who (services/runtime/audit.py)
            check = rule.check_for(principal.kind) if rule is not None else None
            if check is not None and check.reads_request and hasattr(request, "__aiter__"):
                request = _FirstMessage(request)
            refusal = await self._authorize(method, rule, principal, request)
        except ServiceError as exc:  # Unauthenticated, or Unavailable when the directory cannot answer
            return await _refuse(context, request, exc.code, str(exc))
        if refusal is not None:
            return await _refuse(context, request, grpc.StatusCode.PERMISSION_DENIED, *refusal)
        reset = current_principal.set(principal)
        try:
            return await call(request, context)
        finally:
            current_principal.reset(reset)

    async def _authenticate(self, token: str) -> Principal:
        # compare_digest: the time taken must not reveal how much of the cluster token matched.
        if self._cluster_token and hmac.compare_digest(token.encode(), self._cluster_token):
            return CLUSTER_ADMIN
        if self._directory is None:
            raise Unauthenticated("invalid bearer token")
        return await self._directory.resolve(token)

    async def _certified(self, kind: int, name: str) -> Principal:
        if kind == ADMIN:
            return Principal(ADMIN, name)
        if self._directory is None:
            raise Unauthenticated("a client certificate names a principal, but this service cannot look it up "
                                  "(no metadata_address)")
        return await self._directory.certificate_principal(kind, name)

    async def _authorize(self, method: str, rule: Rule | None, principal: Principal,
                         request: Any) -> tuple[str, str] | None:
        """None to admit; else (description, field) of the refusal."""
        if rule is None:
            return f"{method} is not in the access table (services/runtime/access_rules.py): nobody may call it", ""
        if principal.kind == CLUSTER_ADMIN.kind:
            return None
        check = rule.check_for(principal.kind)
        if check is None:
            return f"{method} is not open to a {principal.kind_name} ({principal.describe()})", ""
        message = await request.first() if isinstance(request, _FirstMessage) else request
        if message is None:  # an empty client stream
            return None
        refusal = await check.refuse(principal, message, self._directory)
        return None if refusal is None else (refusal.reason, refusal.field)


class _FirstMessage:
    """A client stream whose first message a check reads before the servicer reads them all."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream.__aiter__()
        self._first: Any = None
        self._read = False

    async def first(self) -> Any:
        """The first message; None for an empty stream."""
        if not self._read:
            self._first = await anext(self._stream, None)
            self._read = True
        return self._first

    async def __aiter__(self) -> AsyncIterator[Any]:
        first = await self.first()
        if first is not None:
            yield first
        async for message in self._stream:
            yield message


async def _refuse(context: grpc.aio.ServicerContext, request: Any, code: grpc.StatusCode, reason: str,
                  field: str = "") -> None:
    if hasattr(request, "__aiter__"):  # a client stream: read it first (see interceptors._drain)
        await _drain(request)
    violations = [FieldViolation(field, reason)]
    message = summary(violations)
    trailing = tuple(context.trailing_metadata() or ())
    if field:
        trailing += ((DETAILS_KEY, status_details(code, message, violations)),)
    await context.abort(code, message, trailing_metadata=trailing)
