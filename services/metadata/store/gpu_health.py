"""Which GPUs of a node are faulted: the rules, on the node row's ``gpu_health`` JSON.

A GPU becomes faulted when its agent reports a critical Xid event (HeartbeatRequest.gpu_faults),
NVML calls it lost, or its uncorrectable ECC count (NVML's volatile count, since the GPU's last
reset) exceeds the count an operator last accepted for it (0 until then). The first fault is
kept, with its reason and time, until an operator clears it (ClearGpuFault); clearing accepts
the GPU's current ECC count, so the same errors do not fault it again, while new ones do. A
count that drops below the accepted one means the GPU was reset: the lower count is accepted.

The JSON: ``{"telemetry": [GpuTelemetry as JSON, ...], "faults": {"<index>": GpuFault as JSON},
"ecc_accepted": {"<index>": count}}`` (keys are strings: JSON objects have no integer keys).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from silod.v1 import common_pb2

from services.metadata.convert import from_json, to_json


def empty() -> dict[str, Any]:
    return {"telemetry": [], "faults": {}, "ecc_accepted": {}}


def after_heartbeat(health: dict[str, Any] | None, telemetry: Sequence[common_pb2.GpuTelemetry],
                    faults: Sequence[common_pb2.GpuFault], now: datetime) -> dict[str, Any]:
    """``health`` updated with a heartbeat's figures and faults (a new dict; the row's JSON
    column is replaced, never mutated in place, so SQLAlchemy sees the change)."""
    new = copy.deepcopy(health) if health else empty()
    latched: dict[str, Any] = new["faults"]
    accepted: dict[str, int] = new["ecc_accepted"]

    def fault(index: int, reason: str, since: Timestamp | None = None) -> None:
        key = str(index)
        if key not in latched:  # the first fault of a GPU is the one kept
            record = common_pb2.GpuFault(index=index, reason=reason)
            if since is not None and (since.seconds or since.nanos):
                record.since.CopyFrom(since)
            else:
                record.since.FromDatetime(now)
            latched[key] = to_json(record)

    if telemetry:
        new["telemetry"] = [to_json(t) for t in sorted(telemetry, key=lambda t: t.index)]
    for t in telemetry:
        if t.lost:
            fault(t.index, "GPU lost (NVML: GPU_IS_LOST, fallen off the bus)")
        if t.HasField("ecc_uncorrectable_errors"):
            count, key = t.ecc_uncorrectable_errors, str(t.index)
            if count < accepted.get(key, 0):
                accepted[key] = count  # reset since: its new errors count from here
            elif count > accepted.get(key, 0):
                fault(t.index, f"{count} uncorrectable ECC errors")
    for f in faults:
        fault(f.index, f.reason, f.since)
    return new


def faults_changed(before: dict[str, Any] | None, after: dict[str, Any] | None) -> bool:
    """Whether a GPU got or lost a fault between the two (not whether its figures changed)."""
    return (before or {}).get("faults", {}) != (after or {}).get("faults", {})


def after_clear(health: dict[str, Any] | None, index: int) -> dict[str, Any] | None:
    """``health`` without GPU ``index``'s fault (None when it has none), its ECC count accepted."""
    if not health or str(index) not in health.get("faults", {}):
        return None
    new = copy.deepcopy(health)
    del new["faults"][str(index)]
    for t in telemetry_of(new):
        if t.index == index and t.HasField("ecc_uncorrectable_errors"):
            new.setdefault("ecc_accepted", {})[str(index)] = t.ecc_uncorrectable_errors
    return new


def telemetry_of(health: dict[str, Any] | None) -> list[common_pb2.GpuTelemetry]:
    return [from_json(t, common_pb2.GpuTelemetry) for t in (health or {}).get("telemetry", [])]


def faults_of(health: dict[str, Any] | None) -> list[common_pb2.GpuFault]:
    faults = (health or {}).get("faults", {})
    return [from_json(faults[key], common_pb2.GpuFault) for key in sorted(faults, key=int)]
