"""Validation of node registrations, heartbeats and node queries."""

from __future__ import annotations

from silod.v1 import common_pb2

from services.metadata.validation.common import (
    MAX_BYTES,
    check_enum,
    check_float,
    check_int,
    check_identifier,
    check_gpu_type,
    check_string_map,
    check_text,
)
from services.runtime.errors import Problems
from silod.rpc.identifiers import NODE_NAME

MAX_NODE_GPUS = 1024
MAX_LIVENESS_WINDOW_S = 7 * 24 * 3600.0


def normalized_node_spec(spec: common_pb2.NodeSpec, field: str = "spec") -> common_pb2.NodeSpec:
    """A validated copy; an UNSPECIFIED pool means TRAINING. Refused with every problem at once."""
    problems = Problems()
    check = problems.check
    check(check_identifier, spec.name, NODE_NAME, f"{field}.name")
    check(check_enum, spec.pool, common_pb2.NodePool.DESCRIPTOR, f"{field}.pool")
    check(check_int, spec.gpus, f"{field}.gpus", minimum=0, maximum=MAX_NODE_GPUS)
    check(check_text, spec.gpu_model, f"{field}.gpu_model", max_chars=256)
    if spec.gpu_type:
        check(check_gpu_type, spec.gpu_type, f"{field}.gpu_type")
    for capacity in ("cache_capacity_bytes", "memory_cache_bytes", "network_bandwidth_bytes_per_s"):
        check(check_int, getattr(spec, capacity), f"{field}.{capacity}", minimum=0, maximum=MAX_BYTES)
    for address in ("agent_address", "cache_address"):
        value = getattr(spec, address)
        if check(check_text, value, f"{field}.{address}", max_chars=256) and any(ch.isspace() for ch in value):
            problems.add(f"{field}.{address}", f"must be HOST:PORT without spaces, got {value[:80]!r}")
    check(check_string_map, spec.labels, f"{field}.labels", max_entries=64)
    problems.raise_if_any()
    normalized = common_pb2.NodeSpec()
    normalized.CopyFrom(spec)
    normalized.pool = spec.pool or common_pb2.NODE_POOL_TRAINING
    return normalized


def check_node_name(name: str, field: str = "node") -> None:
    check_identifier(name, NODE_NAME, field)


def check_heartbeat(node: str, applied_plan_version: int) -> None:
    check_node_name(node)
    check_int(applied_plan_version, "applied_plan_version", minimum=0, maximum=2**63 - 1)


def check_list_nodes(pool: int, liveness_window_s: float, gpu_type: str = "") -> None:
    check_enum(pool, common_pb2.NodePool.DESCRIPTOR, "pool")
    check_float(liveness_window_s, "liveness_window_s", minimum=0.0, maximum=MAX_LIVENESS_WINDOW_S)
    if gpu_type:
        check_gpu_type(gpu_type, "gpu_type")
