"""Validation of node registrations, heartbeats and node queries."""

from __future__ import annotations

from collections.abc import Sequence

from silod.v1 import common_pb2

from services.metadata.validation.common import (
    MAX_BYTES,
    check_enum,
    check_float,
    check_int,
    check_identifier,
    check_gpu_type,
    check_label,
    check_string_map,
    check_text,
    check_timestamp,
)
from services.runtime.errors import Problems
from silod.rpc.identifiers import NODE_NAME

MAX_NODE_GPUS = 1024
MAX_GPU_FAULTS = 1024  # faults one heartbeat carries (an agent cut off for a while queues them)
MAX_LIVENESS_WINDOW_S = 7 * 24 * 3600.0
MAX_NODE_CPUS = 1e6
MAX_NODE_MEMORY_BYTES = 2**60
RUNTIMES = ("", "process", "contained", "container")  # "" = not reported (an older agent)


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
    check(check_float, spec.cpus, f"{field}.cpus", minimum=0.0, maximum=MAX_NODE_CPUS)
    check(check_int, spec.memory_bytes, f"{field}.memory_bytes", minimum=0, maximum=MAX_NODE_MEMORY_BYTES)
    if spec.runtime not in RUNTIMES:
        problems.add(f"{field}.runtime", f"must be one of {', '.join(repr(r) for r in RUNTIMES[1:])} (or empty), "
                                         f"got {spec.runtime[:80]!r}")
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


def check_heartbeat(node: str, applied_plan_version: int, gpu_telemetry: Sequence[common_pb2.GpuTelemetry] = (),
                    gpu_faults: Sequence[common_pb2.GpuFault] = ()) -> None:
    """Every problem of a heartbeat at once. GPU indices are checked against the node's GPUs by
    the store (:func:`check_gpu_indices`), which knows them."""
    problems = Problems()
    check = problems.check
    check(check_node_name, node)
    check(check_int, applied_plan_version, "applied_plan_version", minimum=0, maximum=2**63 - 1)
    if len(gpu_telemetry) > MAX_NODE_GPUS:
        problems.add("gpu_telemetry", f"at most {MAX_NODE_GPUS} GPUs, got {len(gpu_telemetry)}")
    seen: set[int] = set()
    for i, gpu in enumerate(gpu_telemetry[:MAX_NODE_GPUS]):
        field = f"gpu_telemetry[{i}]"
        if check(check_int, gpu.index, f"{field}.index", minimum=0, maximum=MAX_NODE_GPUS - 1) and gpu.index in seen:
            problems.add(f"{field}.index", f"GPU {gpu.index} appears twice")
        seen.add(gpu.index)
        if gpu.HasField("utilization_ratio"):
            check(check_float, gpu.utilization_ratio, f"{field}.utilization_ratio", minimum=0.0, maximum=1.0)
        for name in ("memory_used_bytes", "memory_total_bytes"):
            if gpu.HasField(name):
                check(check_int, getattr(gpu, name), f"{field}.{name}", minimum=0, maximum=MAX_BYTES)
        if gpu.HasField("temperature_celsius"):
            check(check_float, gpu.temperature_celsius, f"{field}.temperature_celsius", minimum=-273.15, maximum=1000.0)
        if gpu.HasField("ecc_uncorrectable_errors"):
            check(check_int, gpu.ecc_uncorrectable_errors, f"{field}.ecc_uncorrectable_errors", minimum=0,
                  maximum=2**62)
    if len(gpu_faults) > MAX_GPU_FAULTS:
        problems.add("gpu_faults", f"at most {MAX_GPU_FAULTS} faults per heartbeat, got {len(gpu_faults)}")
    for i, fault in enumerate(gpu_faults[:MAX_GPU_FAULTS]):
        field = f"gpu_faults[{i}]"
        check(check_int, fault.index, f"{field}.index", minimum=0, maximum=MAX_NODE_GPUS - 1)
        check(check_label, fault.reason, f"{field}.reason", max_chars=256, required=True)
        check(check_timestamp, fault.since, f"{field}.since")
    problems.raise_if_any()


def check_gpu_indices(node: str, gpus: int, gpu_telemetry: Sequence[common_pb2.GpuTelemetry],
                      gpu_faults: Sequence[common_pb2.GpuFault]) -> None:
    """The heartbeat's GPUs are GPUs of the node (its registered spec says how many)."""
    problems = Problems()
    for name, items in (("gpu_telemetry", gpu_telemetry), ("gpu_faults", gpu_faults)):
        for i, item in enumerate(items):
            if item.index >= gpus:
                problems.add(f"{name}[{i}].index", f"node {node} has {gpus} GPUs (0..{gpus - 1}), got {item.index}")
    problems.raise_if_any()


def check_clear_gpu_fault(node: str, gpu_index: int) -> None:
    problems = Problems()
    problems.check(check_node_name, node)
    problems.check(check_int, gpu_index, "gpu_index", minimum=0, maximum=MAX_NODE_GPUS - 1)
    problems.raise_if_any()


def check_node_changes(changed_after: int, *, pool: int, alive_only: bool, gpu_type: str) -> None:
    """A listing of changes answers every changed node, alive or not and of any pool or type: a
    follower that never saw a node (filtered out, or dead when it changed) would not know it when
    it comes back by heartbeats alone."""
    if not changed_after:
        return
    problems = Problems()
    problems.check(check_int, changed_after, "changed_after", minimum=0, maximum=2**63 - 1)
    for field, set_ in (("pool", bool(pool)), ("alive_only", alive_only), ("gpu_type", bool(gpu_type))):
        if set_:
            problems.add(field, "cannot be combined with changed_after: a listing of changes answers "
                                "every changed node, and not_alive names the nodes not alive")
    problems.raise_if_any()


def check_list_nodes(pool: int, liveness_window_s: float, gpu_type: str = "") -> None:
    check_enum(pool, common_pb2.NodePool.DESCRIPTOR, "pool")
    check_float(liveness_window_s, "liveness_window_s", minimum=0.0, maximum=MAX_LIVENESS_WINDOW_S)
    if gpu_type:
        check_gpu_type(gpu_type, "gpu_type")
