"""Tenant quotas from the metadata store's messages (access_pb2.TenantQuota) to the value objects
the quota rule reads (scheduler.quotas.TenantQuota): what the live scheduler does every round."""

from __future__ import annotations

import math
from collections.abc import Iterable

from scheduler.quotas import TenantQuota
from silod.v1 import access_pb2


def quota_from_proto(quota: access_pb2.TenantQuota) -> TenantQuota:
    return TenantQuota(
        gpus={entry.gpu_type: entry.gpus for entry in quota.gpus if entry.gpus > 0},
        cache_bytes=float(quota.cache_bytes) if quota.HasField("cache_bytes") else math.inf,
        remote_io_share=quota.remote_io_share if quota.HasField("remote_io_share") else 1.0,
        borrowing_limit_gpus=quota.borrowing_limit_gpus if quota.HasField("borrowing_limit_gpus") else None,
        lending_limit_gpus=quota.lending_limit_gpus if quota.HasField("lending_limit_gpus") else None,
    )


def quotas_of(tenants: Iterable[access_pb2.Tenant]) -> dict[str, TenantQuota]:
    """Tenant -> quota, for the tenants (ListTenants) that have one."""
    return {t.name: quota_from_proto(t.quota) for t in tenants if t.HasField("quota")}
