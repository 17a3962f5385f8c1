"""Tenant quotas for a simulation: ``silod simulate run --tenant-quotas FILE``.

The file is YAML (or JSON, which YAML reads too), one entry per tenant under ``tenants``::

    tenants:
      team-a:
        gpus: 16                 # nominal GPUs of any type (untyped clusters)
      team-b:
        gpus: {v100: 8, k80: 4}  # nominal GPUs per GPU type (typed clusters)
        cache_bytes: 200e9       # ceiling on its jobs' cache quotas, bytes (default: none)
        remote_io_share: 0.25    # ceiling on its jobs' remote IO, fraction of the storage budget (default 1)
        borrowing_limit_gpus: 8  # GPUs it may hold beyond nominal (default: no limit)
        lending_limit_gpus: 4    # idle nominal GPUs it lends at most (default: all)

Jobs name their tenant in the workload's ``tenant`` column. The rule is the live
scheduler's (:mod:`scheduler.quotas`); a tenant absent from the file has no quota.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from scheduler.policy import TenantQuota
from scheduler.quotas import ANY_TYPE
from simulator.errors import SimulatorInputError

FIELDS = ("gpus", "cache_bytes", "remote_io_share", "borrowing_limit_gpus", "lending_limit_gpus")


def load_quotas(path: str | Path) -> dict[str, TenantQuota]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SimulatorInputError(f"--tenant-quotas {path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SimulatorInputError(f"--tenant-quotas {path}: not YAML/JSON: {exc}") from None
    return parse_quotas(data, str(path))


def parse_quotas(data: Any, source: str = "quotas") -> dict[str, TenantQuota]:
    """Tenant -> quota from the file's parsed contents; ``SimulatorInputError`` naming the field."""
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict):
        raise SimulatorInputError(f"{source}: expected a mapping 'tenants: {{NAME: {{gpus: N, ...}}}}'")
    out: dict[str, TenantQuota] = {}
    for tenant, entry in data["tenants"].items():
        where = f"{source}: tenants.{tenant}"
        if not isinstance(entry, dict):
            raise SimulatorInputError(f"{where}: expected a mapping of {', '.join(FIELDS)}")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise SimulatorInputError(f"{where}.{unknown[0]}: unknown field; known: {', '.join(FIELDS)}")
        gpus = entry.get("gpus", {})
        if isinstance(gpus, int) and not isinstance(gpus, bool):
            gpus = {ANY_TYPE: gpus}
        if not isinstance(gpus, dict) or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in gpus.values()):
            raise SimulatorInputError(f"{where}.gpus: expected a whole number >= 0 or {{type: number, ...}}, got {gpus!r}")
        cache = _number(entry.get("cache_bytes", math.inf), f"{where}.cache_bytes", low=0.0)
        share = _number(entry.get("remote_io_share", 1.0), f"{where}.remote_io_share", low=0.0, high=1.0)
        limits = {}
        for key in ("borrowing_limit_gpus", "lending_limit_gpus"):
            value = entry.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SimulatorInputError(f"{where}.{key}: expected a whole number >= 0, got {value!r}")
            limits[key] = value
        out[str(tenant)] = TenantQuota(gpus={str(k): v for k, v in gpus.items() if v > 0}, cache_bytes=cache,
                                       remote_io_share=share, **limits)
    return out


def _number(value: Any, field: str, *, low: float, high: float = math.inf) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SimulatorInputError(f"{field}: expected a number, got {value!r}") from None
    if math.isnan(number) or not low <= number <= high:
        raise SimulatorInputError(f"{field}: expected a number in [{low:g}, {high:g}], got {value!r}")
    return number
