"""``silod nodes``: the cluster's nodes as an operator checks them (metadata's ListNodes and the
latest plan): pool, GPU type, GPUs in use by the plan, cache size, liveness, last heartbeat,
and the plan version the node's agent applied.

The metadata address comes from --metadata, else SILOD_METADATA_ADDR, else the cluster.json
that `silod up` writes (like `silod logs`).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from silod.cli.client_commands import _add_connection_flags, _human_bytes
from silod.cli.jobs import _age, nodes_and_plan
from silod.cli.up import default_state_dir


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    nodes = sub.add_parser("nodes", help="list nodes: pool, GPU type, GPUs in use, cache, alive, last heartbeat")
    nodes.add_argument("--json", action="store_true", help="one JSON object per node instead of the table")
    nodes.add_argument("--metadata", default="", help="metadata HOST:PORT (env SILOD_METADATA_ADDR; default: from cluster.json)")
    nodes.add_argument("--state-dir", default=default_state_dir(), help="where `silod up` wrote cluster.json (env SILOD_STATE_DIR)")
    _add_connection_flags(nodes)
    nodes.set_defaults(handler=_nodes)


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
    print(f"{'NAME':<20} {'POOL':<9} {'TYPE':<8} {'GPUS':>7} {'CACHE':>9} {'ALIVE':<5} {'HEARTBEAT':>9} {'PLAN':>6}")
    for r in rows:
        print(f"{r['name'][:20]:<20} {r['pool']:<9} {(r['gpu_type'] or '-')[:8]:<8} {r['gpus_used']:>3}/{r['gpus']:<3} "
              f"{_human_bytes(r['cache_bytes']):>9} {'yes' if r['alive'] else 'NO':<5} {r['heartbeat_age']:>9} "
              f"{r['applied_plan_version'] or '-':>6}")
    return 0


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
            "gpus": spec.gpus,
            "gpus_used": min(used.get(spec.name, 0), spec.gpus),
            "cache_bytes": spec.cache_capacity_bytes + spec.memory_cache_bytes,
            "alive": node.alive,
            "heartbeat_age": _age(node.last_heartbeat),
            "applied_plan_version": node.applied_plan_version,
            "agent_address": spec.agent_address,
            "cache_address": spec.cache_address,
        })
    return rows
