"""Every problem of a request in one answer: field violations in the gRPC status details.

A silod service that refuses a request lists each problem it found as a
``google.rpc.BadRequest.FieldViolation`` (field path, description) in the status details
(the ``grpc-status-details-bin`` trailer, a ``google.rpc.Status``: what grpcio-status and
other languages' gRPC libraries read), and also writes them into the status message as
``field: description; field: description``, so a client that reads only the message still sees
them all. :func:`field_violations` reads them back from any ``grpc.RpcError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import grpc

DETAILS_KEY = "grpc-status-details-bin"
MAX_VIOLATIONS = 50  # per answer; the message says how many more there were
# The status message and the details travel as trailers, and gRPC clients refuse trailers over
# 8 KiB in all (RESOURCE_EXHAUSTED "metadata size exceeds soft limit", in place of the answer):
# both are kept well inside it, the details (base64 on the wire) under ~3.4 KiB.
MAX_MESSAGE_CHARS = 2000
MAX_DETAILS_BYTES = 2500
MAX_DESCRIPTION_CHARS = 1000  # a hint such as the command to run must fit whole


class FieldViolation(NamedTuple):
    field: str  # path in the request, e.g. "spec.batch_size", "queries[3].job_id"; "" = the request
    description: str


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summary(violations: Sequence[FieldViolation], omitted: int = 0) -> str:
    """The status message for ``violations``: ``field: description`` joined by ``; ``, as many
    as fit in MAX_MESSAGE_CHARS (the rest counted at the end)."""
    parts: list[str] = []
    size = 0
    for v in violations:
        part = _cut(f"{v.field}: {v.description}" if v.field else v.description, MAX_DESCRIPTION_CHARS)
        if parts and size + len(part) + 2 > MAX_MESSAGE_CHARS - 40:
            break
        parts.append(part)
        size += len(part) + 2
    omitted += len(violations) - len(parts)
    text = "; ".join(parts)
    if omitted:
        text += f" (and {omitted} more problems)"
    return text


def status_details(code: grpc.StatusCode, message: str, violations: Sequence[FieldViolation]) -> bytes:
    """A serialized ``google.rpc.Status`` holding a ``google.rpc.BadRequest``: as many violations
    as fit in MAX_DETAILS_BYTES, each description cut to MAX_DESCRIPTION_CHARS."""
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    bad_request = error_details_pb2.BadRequest()
    for v in violations:
        bad_request.field_violations.add(field=_cut(v.field, MAX_DESCRIPTION_CHARS),
                                         description=_cut(v.description, MAX_DESCRIPTION_CHARS))
        if bad_request.ByteSize() > MAX_DETAILS_BYTES - 300 and len(bad_request.field_violations) > 1:
            del bad_request.field_violations[-1]
            break
    detail = any_pb2.Any()
    detail.Pack(bad_request)
    return status_pb2.Status(code=code.value[0], message=_cut(message, 200), details=[detail]).SerializeToString()


def _trailer(exc: Any) -> bytes | None:
    try:
        metadata = exc.trailing_metadata() or ()
    except Exception:
        return None
    for key, value in metadata:
        if key == DETAILS_KEY:
            return value if isinstance(value, bytes) else None
    return None


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\]|\.[A-Za-z_][A-Za-z0-9_]*)*): (.*)$", re.S)


def field_violations(exc: Any) -> list[FieldViolation]:
    """The problems a silod service listed in its answer (empty for a status without any).

    Reads the ``google.rpc.BadRequest`` of the status details; a status without details (an
    older or foreign server) whose message starts with ``field: `` counts as one violation.
    """
    raw = _trailer(exc)
    if raw:
        from google.protobuf.message import DecodeError
        from google.rpc import error_details_pb2, status_pb2

        try:
            status = status_pb2.Status.FromString(raw)
        except DecodeError:
            status = None
        if status is not None:
            found: list[FieldViolation] = []
            for detail in status.details:
                if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad_request = error_details_pb2.BadRequest()
                    detail.Unpack(bad_request)
                    found += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
            if found:
                return found
    details = exc.details() if callable(getattr(exc, "details", None)) else ""
    match = _FIELD_PREFIX.match(details or "")
    return [FieldViolation(match.group(1), match.group(2))] if match else []


def describe(exc: Any) -> list[str]:
    """Lines for a person: ``CODE: field: problem``, one per violation (one line if none)."""
    code = exc.code().name if callable(getattr(exc, "code", None)) else "ERROR"
    violations = field_violations(exc)
    if not violations:
        return [f"{code}: {exc.details() if callable(getattr(exc, 'details', None)) else exc}"]
    lines = [f"{code}: {v.field}: {v.description}" if v.field else f"{code}: {v.description}" for v in violations]
    details = exc.details() or ""
    more = re.search(r"\(and (\d+) more problems\)$", details)
    if more:
        lines.append(f"{code}: ... and {more.group(1)} more problems")
    return lines


def join_paths(prefix: str, field: str) -> str:
    """``prefix`` + ``field`` as one path: ("transitions[2]", "job_id") -> "transitions[2].job_id"."""
    if not prefix:
        return field
    if not field:
        return prefix
    return f"{prefix}{field}" if field.startswith("[") else f"{prefix}.{field}"


def renamed(violations: Iterable[FieldViolation], fields: dict[str, str]) -> list[FieldViolation] | None:
    """``violations`` with their field paths moved from one request to another by ``fields``
    (downstream path prefix -> caller path prefix); None if one of them is not covered."""
    out = []
    for v in violations:
        for source, target in sorted(fields.items(), key=lambda item: -len(item[0])):
            if v.field == source or (source and v.field.startswith((source + ".", source + "["))) or source == "":
                out.append(FieldViolation(join_paths(target, v.field[len(source):].lstrip(".")) if source
                                          else join_paths(target, v.field), v.description))
                break
        else:
            return None
    return out
