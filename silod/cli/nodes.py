"""``silod nodes``: the cluster's nodes as an operator checks them (metadata's ListNodes and the
latest plan): pool, GPU type, how its agent runs ranks (runtime), GPUs in use by the plan, the
cores and memory ranks may request there ("-": not reported), cache size, liveness, last
heartbeat, and the plan version the node's agent applied; where agents measure their GPUs (NVML), also
the GPUs' mean utilisation, their memory in use and the faulted ones, each fault listed below
the table.

``silod nodes clear-gpu-fault NODE GPU_INDEX``: an operator's word that a faulted GPU is fit
again (MetadataService.ClearGpuFault); the scheduler uses it from its next round.

The metadata address comes from --metadata, else SILOD_METADATA_ADDR, else the cluster.json
that `silod up` writes (like `silod logs`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import grpc

from silod.cli import locate
from silod.cli.client_commands import _human_bytes, call, identifier
from silod.cli.jobs import _age, nodes_and_plan
from silod.rpc.identifiers import NODE_NAME


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    nodes = sub.add_parser("nodes", help="list nodes: pool, GPU type, runtime, GPUs in use, cores, memory, cache, "
                                          "alive, last heartbeat")
    nodes.add_argument("--json", action="store_true", help="one JSON object per node instead of the table")
    locate.add_flags(nodes, "metadata")
    nodes.set_defaults(handler=_nodes)
    actions = nodes.add_subparsers(dest="nodes_command", metavar="ACTION")
    clear = actions.add_parser(
        "clear-gpu-fault", help="put a faulted GPU back into use (after fixing or resetting it)",
        description="Clear the fault of GPU GPU_INDEX of node NODE: the scheduler places on it again from its next "
        "round. Its current uncorrectable ECC count is accepted: only new errors fault it again.")
    clear.add_argument("node", metavar="NODE", type=identifier(NODE_NAME), help="node name, as `silod nodes` lists it")
    clear.add_argument("gpu_index", metavar="GPU_INDEX", type=_gpu_index, help="the GPU's index on the node (0-based)")
    locate.add_flags(clear, "metadata")
    clear.set_defaults(handler=_clear_gpu_fault)


def _gpu_index(value: str) -> int:
    try:
        index = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
    if index < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {index}")
    return index


def _clear_gpu_fault(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2, metadata_pb2_grpc

    def body(channel: grpc.Channel) -> int:
        node = metadata_pb2_grpc.MetadataServiceStub(channel).ClearGpuFault(
            metadata_pb2.ClearGpuFaultRequest(node=args.node, gpu_index=args.gpu_index), timeout=10)
        _say_cleared(args, node)
        return 0

    return call(args, "metadata", body)


def _say_cleared(args: argparse.Namespace, node: Any) -> None:
    left = ", ".join(str(f.index) for f in node.gpu_faults) or "none"
    print(f"GPU {args.gpu_index} of {args.node} is back in use (faulted GPUs left on the node: {left})")


def _nodes(args: argparse.Namespace) -> int:
    view = nodes_and_plan(args)
    if isinstance(view, int):
        return view
    nodes, plan = view
    rows = node_rows(nodes, plan)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print("no nodes have registered yet (a node appears when its worker agent starts)")
        return 0
    for line in node_table(rows):
        print(line)
    faults = [(r["name"], f) for r in rows for f in r["gpu_faults"]]
    if faults:
        print("\nfaulted GPUs (the scheduler places nothing on them; once fixed: silod nodes clear-gpu-fault NODE GPU_INDEX):")
        for name, f in faults:
            print(f"  {name}:{f['index']}  {f['reason']}  (since {f['since_age']} ago)")
    return 0


def node_table(rows: list[dict[str, Any]]) -> list[str]:
    """The table of :func:`node_rows`: a header and one line per node."""
    # The GPU columns only where agents measure their GPUs (NVML): emulated GPUs have no figures.
    measured = any(r["gpu_telemetry"] or r["gpu_faults"] for r in rows)
    header = (f"{'NAME':<20} {'POOL':<9} {'TYPE':<8} {'RUNTIME':<9} {'GPUS':>7} {'CPUS':>6} {'MEMORY':>10} {'CACHE':>9} "
              f"{'ALIVE':<5} {'HEARTBEAT':>9} {'PLAN':>6}")
    lines = [header + (f" {'UTIL':>5} {'GPU-MEM':>19} FAULTED" if measured else "")]
    for r in rows:
        cpus = f"{r['cpus']:g}" if r["cpus"] else "-"  # 0: not reported (an older agent)
        memory = _human_bytes(r["memory_bytes"]) if r["memory_bytes"] else "-"
        line = (f"{r['name'][:20]:<20} {r['pool']:<9} {(r['gpu_type'] or '-')[:8]:<8} {(r['runtime'] or '-')[:9]:<9} "
                f"{r['gpus_used']:>3}/{r['gpus']:<3} {cpus:>6} {memory:>10} "
                f"{_human_bytes(r['cache_bytes']):>9} {'yes' if r['alive'] else 'NO':<5} {r['heartbeat_age']:>9} "
                f"{r['applied_plan_version'] or '-':>6}")
        if measured:
            util = r["gpu_utilization_ratio"]
            gpu_memory = (f"{_human_bytes(r['gpu_memory_used_bytes'])}/{_human_bytes(r['gpu_memory_total_bytes'])}"
                          if r["gpu_memory_total_bytes"] else "-")
            line += (f" {'-' if util is None else f'{100 * util:.0f}%':>5} {gpu_memory:>19} "
                     f"{','.join(str(f['index']) for f in r['gpu_faults']) or '-'}")
        lines.append(line)
    return lines


def node_rows(nodes: list[Any], plan: Any | None) -> list[dict[str, Any]]:
    """One dict per node, sorted by name; ``gpus_used`` counts the distinct GPUs the plan gives
    to training jobs (lent ones included) or to inference replicas that are serving or kept warm
    (a sleeping replica's GPU is free to lend, so it is not counted)."""
    from silod.v1 import common_pb2, plan_pb2

    busy: set[tuple[str, int]] = set()
    if plan is not None:
        for job in plan.jobs:
            for placement in job.placements:
                busy.update((placement.node, index) for index in placement.gpu_indices)
        serving = (plan_pb2.REPLICA_STATE_RUNNING, plan_pb2.REPLICA_STATE_PROTECT)
        busy.update((r.node, r.gpu_index) for r in plan.replicas if r.state in serving)
    used = Counter(node for node, _ in busy)
    rows = []
    for node in sorted(nodes, key=lambda n: n.spec.name):
        spec = node.spec
        rows.append({
            "name": spec.name,
            "pool": common_pb2.NodePool.Name(spec.pool).removeprefix("NODE_POOL_").lower().replace("unspecified", "training"),
            "gpu_type": spec.gpu_type,
            "runtime": spec.runtime,  # "" = not reported
            "gpus": spec.gpus,
            "cpus": spec.cpus,  # cores ranks may request; 0 = not reported
            "memory_bytes": spec.memory_bytes,  # bytes ranks may request; 0 = not reported
            "gpus_used": min(used.get(spec.name, 0), spec.gpus),
            "cache_bytes": spec.cache_capacity_bytes + spec.memory_cache_bytes,
            "alive": node.alive,
            "heartbeat_age": _age(node.last_heartbeat),
            "applied_plan_version": node.applied_plan_version,
            "agent_address": spec.agent_address,
            "cache_address": spec.cache_address,
            **_gpu_figures(node),
        })
    return rows


def _gpu_figures(node: Any) -> dict[str, Any]:
    """The node's GPU figures (NVML; empty for emulated GPUs) and faults, for the table and --json."""
    from google.protobuf import json_format

    telemetry = list(node.gpu_telemetry)
    utils = [t.utilization_ratio for t in telemetry if t.HasField("utilization_ratio")]
    return {
        "gpu_utilization_ratio": sum(utils) / len(utils) if utils else None,  # mean over the GPUs reporting it
        "gpu_memory_used_bytes": sum(t.memory_used_bytes for t in telemetry if t.HasField("memory_used_bytes")),
        "gpu_memory_total_bytes": sum(t.memory_total_bytes for t in telemetry if t.HasField("memory_total_bytes")),
        "gpu_telemetry": [json_format.MessageToDict(t, preserving_proto_field_name=True) for t in telemetry],
        "gpu_faults": [{"index": f.index, "reason": f.reason, "since": f.since.ToJsonString(),
                        "since_age": _age(f.since)} for f in node.gpu_faults],
    }
