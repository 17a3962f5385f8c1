"""The audit log: rows the services' recorders hand in (services/runtime/audit.py), read back
newest first by admins (ListAuditEvents, ``silod admin audit``).

Appending stores each event as given, stamped with an increasing id; the recorder has already
bounded every text (so a hostile request's fields cannot bloat the log), and the checks here
refuse what a recorder would never send, naming the field. Old rows go by retention
(services/metadata/store/retention.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from sqlalchemy import and_, select
from sqlalchemy.sql.elements import ColumnElement
from silod.v1 import access_pb2, audit_pb2

from services.metadata import paging
from services.metadata.clock import from_timestamp, to_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.models import AuditEvent
from services.metadata.validation.common import check_enum, check_text, check_timestamp
from services.runtime.errors import InvalidArgument

MAX_APPEND = 1000  # events per AppendAuditEvents call
AUDIT = paging.PageBounds(default=100, maximum=1000)

# AuditEvent's text fields: (column, its length as migration 0006 declares it); the recorder cuts to these.
TEXT_FIELDS = {"principal_name": ("principal_name", 128), "credential": ("credential_id", 32),
               "method": ("method", 160), "target_job": ("job_id", 64), "target_dataset": ("dataset", 256),
               "target_tenant": ("tenant", 128), "target_node": ("node", 128), "message": ("message", 1024),
               "peer": ("peer", 256), "service": ("service", 64), "reporter": ("reporter", 160)}
REQUIRED = ("method", "service", "reporter")
DENIED_CODES = (grpc.StatusCode.PERMISSION_DENIED.value[0], grpc.StatusCode.UNAUTHENTICATED.value[0])


class AuditStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def append(self, events: Sequence[audit_pb2.AuditEvent]) -> int:
        if not 1 <= len(events) <= MAX_APPEND:
            raise InvalidArgument(f"must hold 1..{MAX_APPEND} events, got {len(events)}", field="events")
        rows = [_row(event, f"events[{i}]") for i, event in enumerate(events)]
        with self._db.write() as session:
            session.add_all(rows)
        return len(rows)

    def list(self, request: audit_pb2.ListAuditEventsRequest) -> tuple[list[audit_pb2.AuditEvent], str]:
        """Newest first (by id, the order rows were stored), within [since, until)."""
        size = AUDIT.size(request.page_size)
        before = paging.decode_token(request.page_token, "audit", int)
        conditions = _filters(request)
        if before:
            conditions.append(AuditEvent.id < before[0])
        query = select(AuditEvent).where(*conditions).order_by(AuditEvent.id.desc()).limit(size + 1)
        with self._db.read() as session:
            rows = session.scalars(query).all()
            page = rows[:size]
            token = paging.encode_token("audit", page[-1].id) if len(rows) > size else ""
            return [_proto(row) for row in page], token


def _row(event: audit_pb2.AuditEvent, where: str) -> AuditEvent:
    check_enum(event.principal_kind, access_pb2.PrincipalKind.DESCRIPTOR, f"{where}.principal_kind")
    for name, (_, bound) in TEXT_FIELDS.items():
        check_text(getattr(event, name), f"{where}.{name}", max_chars=bound, required=name in REQUIRED)
    if event.code not in {code.value[0] for code in grpc.StatusCode}:
        raise InvalidArgument(f"must be a gRPC status code number (0..16), got {event.code}", field=f"{where}.code")
    if event.HasField("time"):
        check_timestamp(event.time, f"{where}.time")
    return AuditEvent(time=from_timestamp(event.time) if event.HasField("time") else utc_now(),
                      principal_kind=event.principal_kind, code=event.code,
                      **{column: getattr(event, name) for name, (column, _) in TEXT_FIELDS.items()})


def _filters(request: audit_pb2.ListAuditEventsRequest) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if request.HasField("since"):
        check_timestamp(request.since, "since")
        conditions.append(AuditEvent.time >= from_timestamp(request.since))
    if request.HasField("until"):
        check_timestamp(request.until, "until")
        if request.HasField("since") and from_timestamp(request.until) < from_timestamp(request.since):
            raise InvalidArgument("must not be before since", field="until")
        conditions.append(AuditEvent.time < from_timestamp(request.until))
    check_enum(request.principal_kind, access_pb2.PrincipalKind.DESCRIPTOR, "principal_kind")
    if request.principal_kind:
        conditions.append(AuditEvent.principal_kind == request.principal_kind)
    for name, column in (("principal", AuditEvent.principal_name), ("job_id", AuditEvent.job_id),
                         ("tenant", AuditEvent.tenant)):
        value = check_text(getattr(request, name), name, max_chars=256)
        if value:
            conditions.append(column == value)
    method = check_text(request.method, "method", max_chars=160)
    if method.startswith("/"):
        conditions.append(AuditEvent.method == method)
    elif method:
        if "/" in method:
            raise InvalidArgument(f"must be a full method (/silod.v1.Service/Method) or a method name, got {method!r}",
                                  field="method")
        conditions.append(AuditEvent.method.endswith(f"/{method}", autoescape=True))
    check_enum(request.outcome, audit_pb2.AuditOutcome.DESCRIPTOR, "outcome")
    if request.outcome == audit_pb2.AUDIT_OUTCOME_OK:
        conditions.append(AuditEvent.code == 0)
    elif request.outcome == audit_pb2.AUDIT_OUTCOME_DENIED:
        conditions.append(AuditEvent.code.in_(DENIED_CODES))
    elif request.outcome == audit_pb2.AUDIT_OUTCOME_ERROR:
        conditions.append(and_(AuditEvent.code != 0, AuditEvent.code.not_in(DENIED_CODES)))
    return conditions


def _proto(row: AuditEvent) -> audit_pb2.AuditEvent:
    return audit_pb2.AuditEvent(id=row.id, time=to_timestamp(row.time), principal_kind=row.principal_kind,
                                code=row.code, **{name: getattr(row, column) for name, (column, _) in TEXT_FIELDS.items()})


__all__ = ["AuditStore", "DENIED_CODES", "MAX_APPEND", "TEXT_FIELDS"]
