"""`silod admin audit`: who called what, when, with what outcome (the metadata service's audit log,
ListAuditEvents; admin only). Newest first; each flag narrows the listing.

What the log records: docs/operators.md "Audit log".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import grpc

from silod.cli import locate
from silod.cli.client_commands import call, identifier
from silod.rpc.identifiers import JOB_ID, TENANT

KINDS = ("admin", "user", "node", "job")
OUTCOMES = ("ok", "denied", "error")
MAX_LIMIT = 10_000
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_parser(admin_sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    audit = admin_sub.add_parser(
        "audit", help="the audit log: who called what, when, with what outcome (newest first)",
        description="Each flag narrows the listing. Times: a duration ago (90s, 15m, 1h, 7d) or a UTC time "
                    "(2026-11-28T01:00:00Z).")
    audit.add_argument("--since", type=_when, default=None, metavar="WHEN", help="only events at or after WHEN")
    audit.add_argument("--until", type=_when, default=None, metavar="WHEN", help="only events before WHEN")
    audit.add_argument("--principal", default="", metavar="NAME", help="only calls by this user, node, job or admin label")
    audit.add_argument("--kind", choices=KINDS, default="", help="only calls by this kind of principal")
    audit.add_argument("--method", type=_method, default="", metavar="METHOD",
                       help="only this method: CancelJob (of any service) or /silod.v1.JobService/CancelJob")
    audit.add_argument("--outcome", choices=OUTCOMES, default="",
                       help="ok; denied (PERMISSION_DENIED or UNAUTHENTICATED); error (any other failure)")
    audit.add_argument("--job", type=identifier(JOB_ID, required=False), default="", metavar="JOB_ID",
                       help="only calls that named this job")
    audit.add_argument("--tenant", type=identifier(TENANT, required=False), default="", metavar="TENANT",
                       help="only calls that named this tenant (or a job of it)")
    audit.add_argument("--limit", type=_limit, default=50, metavar="N", help=f"at most N events, 1..{MAX_LIMIT} (default 50)")
    audit.add_argument("--json", action="store_true", help="one JSON object per event, one per line")
    audit.set_defaults(handler=_audit)
    locate.add_flags(audit, "metadata")
    return audit


def _when(text: str) -> datetime:
    match = _DURATION.match(text.strip())
    if match:
        return datetime.now(timezone.utc) - timedelta(seconds=float(match[1]) * _SECONDS[match[2]])
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration ago (90s, 15m, 1h, 7d) or a UTC time (2026-11-28T01:00:00Z), got {text!r}") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"say the time zone (a Z or +00:00 at the end), got {text!r}")
    return when


def _method(text: str) -> str:
    if not text or (text.startswith("/") and text.count("/") == 2) or "/" not in text:
        return text
    raise argparse.ArgumentTypeError(f"expected a method name (CancelJob) or a full method "
                                     f"(/silod.v1.JobService/CancelJob), got {text!r}")


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be a whole number in 1..{MAX_LIMIT}, got {text!r}")
    return value


def _request(args: argparse.Namespace) -> Any:
    from silod.v1 import access_pb2, audit_pb2

    request = audit_pb2.ListAuditEventsRequest(
        principal=args.principal, method=args.method, job_id=args.job, tenant=args.tenant,
        principal_kind=access_pb2.PrincipalKind.Value(f"PRINCIPAL_KIND_{args.kind.upper()}") if args.kind else 0,
        outcome=audit_pb2.AuditOutcome.Value(f"AUDIT_OUTCOME_{args.outcome.upper()}") if args.outcome else 0)
    if args.since is not None:
        request.since.FromDatetime(args.since)
    if args.until is not None:
        request.until.FromDatetime(args.until)
    return request


def _audit(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2_grpc

    if args.since is not None and args.until is not None and args.until < args.since:
        print("silod: --until: must not be before --since", file=sys.stderr)
        return 2

    def body(channel: grpc.Channel) -> int:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        request = _request(args)
        events: list[Any] = []
        while len(events) < args.limit:
            request.page_size = min(1000, args.limit - len(events))
            page = stub.ListAuditEvents(request, timeout=30)
            events.extend(page.events)
            if not page.next_page_token:
                break
            request.page_token = page.next_page_token
        if args.json:
            for event in events:
                print(json.dumps(as_dict(event), sort_keys=True))
        else:
            print_table(events)
        return 0

    return call(args, "metadata", body)


def as_dict(event: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    out = json_format.MessageToDict(event, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    out["code_name"] = _code_name(event.code)
    return out


def _code_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


def _who(event: Any) -> str:
    from silod.v1 import access_pb2

    if not event.principal_kind:
        return "unauthenticated" + (f" ({event.credential})" if event.credential else "")
    kind = access_pb2.PrincipalKind.Name(event.principal_kind).removeprefix("PRINCIPAL_KIND_").lower()
    return f"{kind} {event.principal_name}" + (f" ({event.credential})" if event.credential else "")


def _target(event: Any) -> str:
    parts = [f"{name}={value}" for name, value in (("job", event.target_job), ("tenant", event.target_tenant),
                                                   ("dataset", event.target_dataset), ("node", event.target_node))
             if value]
    return " ".join(parts) or "-"


def print_table(events: list[Any]) -> None:
    rows = [("TIME (UTC)", "WHO", "METHOD", "TARGET", "OUTCOME", "PEER")]
    for e in events:
        when = e.time.ToDatetime(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        outcome = _code_name(e.code) + (f": {e.message}" if e.message else "")
        method = e.method.removeprefix("/silod.v1.")
        rows.append((when, _who(e), method, _target(e), outcome[:120], e.peer))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    if len(rows) == 1:
        print("(no events match)", file=sys.stderr)
