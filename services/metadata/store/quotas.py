"""Tenant quotas: set, removed and read with the tenants (a row per tenant that has one).

The quota is kept as the ``access_pb2.TenantQuota`` message in JSON (proto field names), like
the other nested messages of the store. What a quota means is the scheduler's
(scheduler/quotas.py, docs/tenants.md); here it is checked field by field and stored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from sqlalchemy import select

from services.metadata.clock import to_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.models import Tenant, TenantQuotaRow
from services.metadata.validation.access import check_tenant_name
from services.runtime.errors import NotFound, Problems
from silod.v1 import access_pb2

MAX_GPUS = 1_000_000          # per entry: a typo guard, far above any cluster
MAX_GPU_TYPE_CHARS = 64


def check_quota(quota: access_pb2.TenantQuota, field: str = "quota") -> None:
    """INVALID_ARGUMENT naming each bad field of ``quota``."""
    problems = Problems()
    seen: set[str] = set()
    for k, entry in enumerate(quota.gpus):
        where = f"{field}.gpus[{k}]"
        if len(entry.gpu_type) > MAX_GPU_TYPE_CHARS or any(ch.isspace() or ch in "=,/" for ch in entry.gpu_type):
            problems.add(f"{where}.gpu_type", f"a GPU type name of at most {MAX_GPU_TYPE_CHARS} characters without "
                                              f"spaces, '=', ',' or '/', got {entry.gpu_type!r}")
        if entry.gpu_type in seen:
            problems.add(f"{where}.gpu_type", f"type {entry.gpu_type or '(any)'!r} given twice")
        seen.add(entry.gpu_type)
        if not 0 <= entry.gpus <= MAX_GPUS:
            problems.add(f"{where}.gpus", f"GPUs in [0, {MAX_GPUS}], got {entry.gpus}")
    if quota.HasField("cache_bytes") and quota.cache_bytes < 0:
        problems.add(f"{field}.cache_bytes", f"bytes >= 0, got {quota.cache_bytes}")
    if quota.HasField("remote_io_share") and not (math.isfinite(quota.remote_io_share) and 0 <= quota.remote_io_share <= 1):
        problems.add(f"{field}.remote_io_share", f"a fraction in [0, 1], got {quota.remote_io_share}")
    for name in ("borrowing_limit_gpus", "lending_limit_gpus"):
        if quota.HasField(name) and not 0 <= getattr(quota, name) <= MAX_GPUS:
            problems.add(f"{field}.{name}", f"GPUs in [0, {MAX_GPUS}], got {getattr(quota, name)}")
    problems.raise_if_any()


class QuotaStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def set_quota(self, name: str, quota: access_pb2.TenantQuota | None) -> None:
        """Set (``quota``) or remove (None) tenant ``name``'s quota; NOT_FOUND without the tenant."""
        check_tenant_name(name)
        if quota is not None:
            check_quota(quota)
        with self._db.write() as session:
            if session.get(Tenant, name) is None:
                raise NotFound(f"no tenant {name!r} (create it with CreateTenant)", field="name")
            row = session.get(TenantQuotaRow, name)
            if quota is None:
                if row is not None:
                    session.delete(row)
                return
            stored = access_pb2.TenantQuota()
            stored.CopyFrom(quota)
            stored.ClearField("updated_at")
            value: dict[str, Any] = json_format.MessageToDict(stored, preserving_proto_field_name=True)
            if row is None:
                session.add(TenantQuotaRow(tenant=name, quota=value, updated_at=utc_now()))
            else:
                row.quota, row.updated_at = value, utc_now()
            session.flush()

    def tenant(self, name: str, tenants: list[access_pb2.Tenant]) -> access_pb2.Tenant:
        """Tenant ``name`` of ``tenants`` (AccessStore.list_tenants) with its quota."""
        found = next((t for t in tenants if t.name == name), None)
        if found is None:
            raise NotFound(f"no tenant {name!r}", field="name")
        return found

    def quotas(self) -> dict[str, access_pb2.TenantQuota]:
        """Tenant -> its quota, for the tenants that have one."""
        with self._db.read() as session:
            rows = session.scalars(select(TenantQuotaRow)).all()
            return {row.tenant: _to_proto(row) for row in rows}


def _to_proto(row: TenantQuotaRow) -> access_pb2.TenantQuota:
    quota = json_format.ParseDict(row.quota, access_pb2.TenantQuota(), ignore_unknown_fields=True)
    quota.updated_at.CopyFrom(to_timestamp(row.updated_at))
    return quota


def attach(tenants: list[access_pb2.Tenant], quotas: Mapping[str, access_pb2.TenantQuota]) -> list[access_pb2.Tenant]:
    """``tenants`` with their quotas filled in."""
    for tenant in tenants:
        if tenant.name in quotas:
            tenant.quota.CopyFrom(quotas[tenant.name])
    return tenants


__all__ = ["QuotaStore", "attach", "check_quota"]
