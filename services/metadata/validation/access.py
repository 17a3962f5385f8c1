"""Checks of the identity and access requests: principal names, lifetimes, member lists."""

from __future__ import annotations

import math
from collections.abc import Sequence

from silod.rpc import identifiers
from silod.v1 import access_pb2

from services.metadata.validation.common import check_identifier, check_text
from services.runtime.errors import InvalidArgument, Problems

# A user (or an admin credential's label) is only a name: the same characters as a tenant.
USER_NAME = identifiers.Rule("user name", 128, examples="alice, ci-bot")
MAX_TTL_S = 10 * 365 * 24 * 3600.0  # ten years: beyond that say "never" (0)
MAX_DESCRIPTION_CHARS = 1024
MAX_MEMBERS = 10_000

KINDS = {
    access_pb2.PRINCIPAL_KIND_ADMIN: USER_NAME,
    access_pb2.PRINCIPAL_KIND_USER: USER_NAME,
    access_pb2.PRINCIPAL_KIND_NODE: identifiers.NODE_NAME,
    access_pb2.PRINCIPAL_KIND_JOB: identifiers.JOB_ID,
}


def check_kind(kind: int, field: str = "kind", *, required: bool = True) -> None:
    if kind == access_pb2.PRINCIPAL_KIND_UNSPECIFIED and not required:
        return
    if kind not in KINDS:
        raise InvalidArgument("must be PRINCIPAL_KIND_ADMIN, _USER, _NODE or _JOB", field=field)


def check_ttl(ttl_s: float, field: str = "ttl_s") -> None:
    if not math.isfinite(ttl_s) or not 0 <= ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"must be 0 (never expires) or seconds up to {MAX_TTL_S:.0f}, got {ttl_s}", field=field)


def check_create_credential(request: access_pb2.CreateCredentialRequest) -> None:
    problems = Problems()
    if problems.check(check_kind, request.kind):
        problems.check(check_identifier, request.name, KINDS[request.kind], "name")
    problems.check(check_ttl, request.ttl_s)
    problems.check(check_text, request.description, "description", max_chars=MAX_DESCRIPTION_CHARS)
    problems.raise_if_any()


def check_members(members: Sequence[str], field: str = "members") -> list[str]:
    """The member list, sorted; every bad name is named by its index."""
    problems = Problems()
    if len(members) > MAX_MEMBERS:
        problems.add(field, f"at most {MAX_MEMBERS} members, got {len(members)}")
    for index, member in enumerate(members[:MAX_MEMBERS]):
        problems.check(check_identifier, member, USER_NAME, f"{field}[{index}]")
    if len(set(members)) != len(members):
        problems.add(field, "must not name a user twice")
    problems.raise_if_any()
    return sorted(members)


def check_tenant_name(name: str, field: str = "name") -> None:
    check_identifier(name, identifiers.TENANT, field)
