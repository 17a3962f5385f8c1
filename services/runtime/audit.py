"""The audit log's recorder: one interceptor that notes who called what and how it ended.

Installed by services/runtime/server.py beside the access interceptor (outside it, so that its
refusals are seen) whenever a process checks credentials. What it records
(:func:`should_record`, docs/operators.md "Audit log"):

- every refused call (PERMISSION_DENIED or UNAUTHENTICATED) of any method, by anyone;
- every call of a method services/runtime/access_rules.py marks MUTATING, whatever its outcome,
  except the control plane's steady traffic (ROUTINE: heartbeats, acks, plan commits, progress
  and metric reports, cache leases) when the cluster token, a node or a job makes it. A person
  (a user or an admin credential) is recorded whatever the method.

Recording must not slow the call: the event goes into an in-memory buffer that a background
task hands to a sink every ``FLUSH_S`` (the metadata service's own store, or the metadata
service's AppendAuditEvents for every other process). A flush that fails is retried; what the
bounded buffer cannot keep is logged, each refusal on a line of its own, never dropped silently.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message
from prometheus_client import Counter
from silod.v1 import access_pb2, audit_pb2

from services.runtime.access_rules import MUTATING, ROUTINE
from services.runtime.auth import bearer_token
from services.runtime.interceptors import Behavior, wrap_handler
from services.runtime.principals import ADMIN, USER, Principal, current_principal, split_token
from services.runtime.structured_logging import get_logger

_log = get_logger("silod.audit")

FLUSH_S = 1.0  # seconds between flushes: an event is in the log about this long after its call
MAX_BUFFERED = 10_000  # events waiting for the sink; beyond it the oldest are logged and let go
BATCH = 1000  # events per append (AppendAuditEvents' bound)
CLOSE_S = 5.0  # what a stopping process gives its last flush
DENIED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
_DENIED_NUMBERS = frozenset(code.value[0] for code in DENIED)
# Column bounds of the audit_events table (services/metadata/store/audit.py): cut here, so a hostile
# request's fields cannot bloat the log or get a batch refused.
BOUNDS = {"principal_name": 128, "credential": 32, "method": 160, "target_job": 64, "target_dataset": 256,
          "target_tenant": 128, "target_node": 128, "message": 1024, "peer": 256, "service": 64}
_NONE = {"target_job": "", "target_dataset": "", "target_tenant": "", "target_node": ""}

EVENTS = Counter("silod_audit_events_total", "Audit log events this process recorded, by what became of them: "
                 "stored (handed to the metadata store) or dropped (the buffer was full or the process stopped "
                 "before the store took them; each is logged instead)", ["service_process", "result"])


def is_person(principal: Principal | None) -> bool:
    """A user, or an admin credential; not the cluster token the services share, not a node or a job."""
    return principal is not None and (principal.kind == USER or (principal.kind == ADMIN and bool(principal.credential_id)))


def should_record(method: str, principal: Principal | None, code: grpc.StatusCode) -> bool:
    if code in DENIED:
        return True
    if method not in MUTATING:
        return False
    return method not in ROUTINE or is_person(principal)


# -- who called: set by the access interceptor (note_principal) inside the call this module wraps --

class _Call:
    __slots__ = ("principal",)

    def __init__(self) -> None:
        self.principal: Principal | None = None


_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("silod_audit_call", default=None)


def note_principal(principal: Principal) -> None:
    """Called by services/runtime/access.py once it knows who calls (before authorizing)."""
    call = _call.get()
    if call is not None:
        call.principal = principal


# -- what the request named ----------------------------------------------------------------------

def _text(value: Any, field: str) -> str:
    text = str(value).replace("\x00", "")
    bound = BOUNDS[field]
    return text if len(text) <= bound else text[: bound - 1] + "…"


def _string(message: Any, name: str) -> str:
    field = message.DESCRIPTOR.fields_by_name.get(name)
    if field is None or field.type != field.TYPE_STRING or field.is_repeated:
        return ""
    return str(getattr(message, name))


def resources(request: Any) -> dict[str, str]:
    """The job, dataset, tenant and node a request names (target_job, ...), by its fields' names and types."""
    found = {"job_id": "", "dataset": "", "tenant": "", "node": ""}
    if not isinstance(request, Message):
        return {"target_" + k.removesuffix("_id"): v for k, v in found.items()}
    for name in found:
        found[name] = _string(request, name)
    kind = request.DESCRIPTOR.name
    spec = getattr(request, "spec", None) if "spec" in request.DESCRIPTOR.fields_by_name else None
    if isinstance(spec, Message):
        spec_kind = spec.DESCRIPTOR.name
        if spec_kind == "JobSpec":
            found["tenant"] = found["tenant"] or spec.tenant  # type: ignore[attr-defined]
        elif spec_kind == "DatasetSpec":
            found["dataset"] = found["dataset"] or spec.name  # type: ignore[attr-defined]
        elif spec_kind == "NodeSpec":
            found["node"] = found["node"] or spec.name  # type: ignore[attr-defined]
    name = _string(request, "name")
    if name and "Tenant" in kind:
        found["tenant"] = found["tenant"] or name
    elif name and "Dataset" in kind:
        found["dataset"] = found["dataset"] or name
    if kind == "CreateCredentialRequest":  # a job's or a node's credential names its subject
        if request.kind == access_pb2.PRINCIPAL_KIND_JOB:  # type: ignore[attr-defined]
            found["job_id"] = found["job_id"] or name
        elif request.kind == access_pb2.PRINCIPAL_KIND_NODE:  # type: ignore[attr-defined]
            found["node"] = found["node"] or name
    return {"target_" + k.removesuffix("_id"): v for k, v in found.items()}


def _safe_resources(request: Any) -> dict[str, str]:
    try:
        return resources(request)
    except Exception:  # noqa: BLE001 - recording must never fail the call it records
        _log.exception("cannot read the resources of a request", extra={"request": type(request).__name__})
        return dict(_NONE)


def _outcome_detail(request: Any, response: Any) -> str:
    """For a successful call, what it made when the resource columns cannot say it: a credential."""
    if isinstance(response, access_pb2.IssuedCredential):
        made = response.credential
        kind = access_pb2.PrincipalKind.Name(made.kind).removeprefix("PRINCIPAL_KIND_").lower()
        return f"issued credential {made.id} for {kind} {made.name!r}"
    if isinstance(response, access_pb2.Credential):
        kind = access_pb2.PrincipalKind.Name(response.kind).removeprefix("PRINCIPAL_KIND_").lower()
        return f"credential {response.id} of {kind} {response.name!r}"
    if isinstance(response, access_pb2.Tenant):
        return f"members: {', '.join(response.members) or 'none'}"
    return ""


async def _peek_first(stream: Any, found: dict[str, str]) -> Any:
    """A client stream passed through unchanged, the resources of its first message noted."""
    async for message in stream:
        if not found:
            found.update(_safe_resources(message))
        yield message


# -- where events go -----------------------------------------------------------------------------

class AuditSink(Protocol):
    async def append(self, events: list[audit_pb2.AuditEvent]) -> None:
        """Store ``events`` (at most BATCH) or raise."""


class StoreSink:
    """The metadata service's own store (services.metadata.store.AuditStore)."""

    def __init__(self, audit_store: Any, reporter: str = "metadata") -> None:
        self._store, self._reporter = audit_store, reporter

    async def append(self, events: list[audit_pb2.AuditEvent]) -> None:
        for event in events:
            event.reporter = self._reporter
        await asyncio.to_thread(self._store.append, events)


class RemoteSink:
    """The metadata service's AppendAuditEvents, called with this process's token."""

    def __init__(self, address: str, token: str, *, tls_ca_file: str = "", timeout_s: float = 10.0) -> None:
        self._address, self._token, self._tls_ca_file, self._timeout_s = address, token, tls_ca_file, timeout_s
        self._channel: grpc.aio.Channel | None = None

    async def append(self, events: list[audit_pb2.AuditEvent]) -> None:
        from silod.rpc.channels import open_channel
        from silod.v1 import metadata_pb2_grpc

        if self._channel is None:  # made on first use: an aio channel belongs to the serving loop
            self._channel = open_channel(self._address, token=self._token, tls_ca_file=self._tls_ca_file, aio=True,
                                         default_timeout_s=self._timeout_s)
        stub = metadata_pb2_grpc.MetadataServiceStub(self._channel)
        await stub.AppendAuditEvents(audit_pb2.AppendAuditEventsRequest(events=events))

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class LogSink:
    """No metadata service to send to: each event becomes a log line."""

    async def append(self, events: list[audit_pb2.AuditEvent]) -> None:
        for event in events:
            _log.info("audit", extra=_fields(event))


def _fields(event: audit_pb2.AuditEvent) -> dict[str, Any]:
    return {"audit_" + name: getattr(event, name) for name in ("principal_kind", *BOUNDS, "code") if getattr(event, name)}


class Noted:
    """What a call left to record, as plain values: the event message is built at flush time, off the call's path."""

    __slots__ = ("time_s", "kind", "code", "values")

    def __init__(self, kind: int, code: int, values: dict[str, str], time_s: float | None = None) -> None:
        self.time_s = time.time() if time_s is None else time_s
        self.kind, self.code, self.values = kind, code, values

    def event(self, service: str) -> audit_pb2.AuditEvent:
        event = audit_pb2.AuditEvent(principal_kind=self.kind, code=self.code, service=_text(service, "service"))
        event.time.FromNanoseconds(int(self.time_s * 1e9))
        for name, value in self.values.items():
            setattr(event, name, _text(value, name))
        return event


# -- the buffer ----------------------------------------------------------------------------------

JobTenant = Callable[[str], Awaitable[str | None]]


class AuditRecorder:
    """Buffers events and hands them to ``sink`` from a background task, in order."""

    def __init__(self, process: str, sink: AuditSink, *, job_tenant: JobTenant | None = None,
                 flush_s: float = FLUSH_S, max_buffered: int = MAX_BUFFERED) -> None:
        self._process, self._sink, self._job_tenant = process, sink, job_tenant
        self._flush_s, self._max = flush_s, max_buffered
        self._buffer: collections.deque[Noted] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def record(self, noted: Noted) -> None:
        """Never blocks, never raises."""
        self._buffer.append(noted)
        while len(self._buffer) > self._max:
            self._drop([self._buffer.popleft()], "the audit buffer is full")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - a bug here must not stop the flushing; events stay buffered
                _log.exception("audit flush failed")

    async def flush(self) -> None:
        while self._buffer:
            noted = [self._buffer[i] for i in range(min(BATCH, len(self._buffer)))]
            batch = [n.event(self._process) for n in noted]
            await self._fill_tenants(batch)
            try:
                await self._sink.append(batch)
            except Exception as exc:  # noqa: BLE001 - kept, retried next flush; the call it records is long done
                if _refused_for_good(exc):  # retrying cannot help: log them rather than block the rest
                    self._drop(noted, f"the metadata service refused them ({exc})"[:300])
                    self._forget(noted)
                    continue
                if not self._failing:
                    _log.warning("cannot store audit events; keeping them to retry",
                                 extra={"buffered": len(self._buffer), "error": f"{type(exc).__name__}: {exc}"[:300]})
                self._failing = True
                return
            if self._failing:
                _log.info("audit events stored again", extra={"buffered": len(self._buffer)})
                self._failing = False
            self._forget(noted)
            EVENTS.labels(self._process, "stored").inc(len(batch))

    def _forget(self, noted: list[Noted]) -> None:
        """Take ``noted`` off the buffer's head, unless the bound already let them go meanwhile."""
        handled = {id(n) for n in noted}
        while self._buffer and id(self._buffer[0]) in handled:
            self._buffer.popleft()

    async def _fill_tenants(self, events: Iterable[audit_pb2.AuditEvent]) -> None:
        """The tenant of the job an event names, when the request did not name one (filter by tenant)."""
        if self._job_tenant is None:
            return
        for event in events:
            if event.target_job and not event.target_tenant:
                with contextlib.suppress(Exception):
                    event.target_tenant = _text(await self._job_tenant(event.target_job) or "", "target_tenant")

    async def close(self) -> None:
        """Stop the background task and flush what is left (within CLOSE_S); log what is not stored."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.flush(), CLOSE_S)
        if self._buffer:
            self._drop(list(self._buffer), "the process stopped before the metadata service stored them")
            self._buffer.clear()
        close = getattr(self._sink, "close", None)
        if close is not None:
            await close()

    def _drop(self, dropped: list[Noted], why: str) -> None:
        EVENTS.labels(self._process, "dropped").inc(len(dropped))
        for noted in dropped:  # each one on a line: an operator can still read who did what
            level = _log.error if noted.code in _DENIED_NUMBERS else _log.warning
            level("audit event not stored: " + why, extra=_fields(noted.event(self._process)))


def _refused_for_good(exc: Exception) -> bool:
    """A refusal of the events themselves (a bad field), not of the moment (unavailable, overloaded)."""
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else getattr(exc, "code", None)
    return code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)


# -- the interceptor -----------------------------------------------------------------------------

class AuditInterceptor(grpc.aio.ServerInterceptor):
    """Outside the access interceptor: sees its refusals and, through note_principal, the caller."""

    def __init__(self, recorder: AuditRecorder) -> None:
        self._recorder = recorder

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        token, _ = bearer_token(handler_call_details.invocation_metadata)
        return wrap_handler(handler, functools.partial(self._around, handler_call_details.method, token))

    async def _around(self, method: str, token: str, call: Behavior, request: Any,
                      context: grpc.aio.ServicerContext) -> Any:
        noted = _Call()
        reset = _call.set(noted)
        found: dict[str, str] = {}  # a client stream's first message, noted as it passes
        if hasattr(request, "__aiter__"):
            request = _peek_first(request, found)
        code, response = grpc.StatusCode.UNKNOWN, None
        try:
            response = await call(request, context)
            code = context.code() or grpc.StatusCode.OK
            return response
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            _call.reset(reset)
            if should_record(method, noted.principal, code):  # only then is the request read: cheap otherwise
                self._record(method, token, noted.principal, found or _safe_resources(request), code, request,
                             response, context)

    def _record(self, method: str, token: str, principal: Principal | None, found: dict[str, str],
                code: grpc.StatusCode, request: Any, response: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            if not found["target_job"] and response is not None and getattr(response.DESCRIPTOR, "full_name", "") == "silod.v1.Job":
                found["target_job"] = response.id  # SubmitJob: the id it gave the job
            if principal is None:  # refused before it was known who: the credential id still says
                split = split_token(token)
                principal = Principal(0, "", credential_id=split[0] if split else "")
            message = (context.details() or "") if code != grpc.StatusCode.OK else _outcome_detail(request, response)
            values = {"principal_name": principal.name, "credential": principal.credential_id, "method": method,
                      "message": message, "peer": context.peer() or "", **found}
            self._recorder.record(Noted(principal.kind, code.value[0], values))
        except Exception:  # noqa: BLE001 - recording must never fail the call it records
            _log.exception("cannot record an audit event", extra={"method": method, "code": code.name})


def recorder_for(process: str, settings: Any, sink: AuditSink | None, job_tenant: JobTenant | None) -> AuditRecorder:
    """The recorder a process runs: ``sink`` (the metadata service's store), else the metadata
    service at settings.metadata_address, else the log."""
    if sink is None:
        address = getattr(settings, "metadata_address", "")
        token = str(getattr(settings, "node_credential", "") or getattr(settings, "auth_token", ""))
        sink = RemoteSink(address, token, tls_ca_file=getattr(settings, "metadata_tls_ca_file", "")) if address else LogSink()
    return AuditRecorder(process, sink, job_tenant=job_tenant)


__all__ = ["AuditInterceptor", "AuditRecorder", "AuditSink", "LogSink", "Noted", "RemoteSink", "StoreSink", "is_person",
           "note_principal", "recorder_for", "resources", "should_record"]
