"""Conversions between the policy's value objects and the plan protos, and per-node plan views."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Set as AbstractSet

from scheduler.live.gpu_health import Placement
from scheduler.policy import Allocation, NodeInfo, Plan
from silod.v1 import common_pb2, plan_pb2

MASTER_PORT_BASE = 29500
MASTER_PORT_RANGE = 1000


def node_info(node: common_pb2.Node) -> NodeInfo:
    spec = node.spec
    pool = "inference" if spec.pool == common_pb2.NODE_POOL_INFERENCE else "training"
    nic = float(spec.network_bandwidth_bytes_per_s) if spec.network_bandwidth_bytes_per_s > 0 else math.inf
    # The cache server checks quotas against all its tiers (disk + memory); a node that names
    # no cache server has no cache to grant, whatever it advertises.
    cache = float(spec.cache_capacity_bytes + spec.memory_cache_bytes) if spec.cache_address else 0.0
    # Cores and memory ranks may request, as reported: a node that reports none (0, an older
    # agent) has none to give, so ranks that request them go elsewhere; ranks that request none
    # need none and are placed there as before.
    return NodeInfo(name=spec.name, gpus=spec.gpus, pool=pool, cache_capacity_bytes=cache, nic_bytes_per_s=nic,
                    gpu_type=spec.gpu_type, cpus=max(0.0, spec.cpus), memory_bytes=float(max(0, spec.memory_bytes)))


def placement_of(allocation: plan_pb2.JobAllocation) -> Placement:
    hit = _COMMITTED.get(id(allocation))
    if hit is not None and hit[0] is allocation:
        return hit[1]
    return _placement(allocation)


def _placement(allocation: plan_pb2.JobAllocation) -> Placement:
    return normalized(((p.node, p.gpu_indices) for p in allocation.placements))


def normalized(placement: Iterable[tuple[str, Iterable[int]]]) -> Placement:
    """A placement as placement_of gives it: nodes by name, GPU indices ascending, no empty node."""
    return tuple(sorted((node, tuple(sorted(indices))) for node, indices in placement if indices))


# The placements of the entries of the last few plans whose entries will not change (committed,
# or built by a round and about to be), computed once per plan: a round at 5,000 jobs asked for
# them some 45,000 times (releases, restarts, metrics, the snapshot, the reports), a quarter of its
# CPU. Keyed by the entry object, held here so that its id stays its own. Used from the event
# loop's thread only.
_COMMITTED: dict[int, tuple[plan_pb2.JobAllocation, Placement]] = {}
_COMMITTED_PLANS: list[tuple[plan_pb2.AllocationPlan, list[plan_pb2.JobAllocation]]] = []  # with the entries kept
KEEP_COMMITTED_PLANS = 4


def remember_placements(plan: plan_pb2.AllocationPlan,
                        known: Mapping[str, Placement] | None = None,
                        only: Iterable[plan_pb2.JobAllocation] | None = None) -> None:
    """``plan``'s entries will not change: their placements are kept, taken from ``known`` (job
    -> placement as placement_of gives it) where the caller has them, else worked out.
    ``only``: keep those entries' only (a plan that changed a few entries of one whose
    placements were read round after round: the others are read by passes over the whole plan,
    which a plan that follows its predecessor by its changes no longer makes)."""
    if any(p is plan for p, _ in _COMMITTED_PLANS):
        return
    entries = list(plan.jobs if only is None else only)
    _COMMITTED_PLANS.append((plan, entries))
    for entry in entries:
        placement = known.get(entry.job_id) if known is not None else None
        _COMMITTED[id(entry)] = (entry, placement if placement is not None else _placement(entry))
    while len(_COMMITTED_PLANS) > KEEP_COMMITTED_PLANS:
        for entry in _COMMITTED_PLANS.pop(0)[1]:
            kept = _COMMITTED.get(id(entry))
            if kept is not None and kept[0] is entry:
                del _COMMITTED[id(entry)]


def plan_from_proto(plan: plan_pb2.AllocationPlan | None) -> Plan:
    if plan is None:
        return Plan()
    allocations: dict[str, Allocation] = {}
    for job in plan.jobs:
        allocation = allocation_of(job)
        if allocation is not None:
            allocations[job.job_id] = allocation
    return Plan(allocations)


def allocation_of(job: plan_pb2.JobAllocation) -> Allocation | None:
    """What the entry gives its job, as the policy's value object; None when it places it nowhere."""
    placement = placement_of(job)
    if not placement:
        return None
    grants = {g.node: float(g.cache_quota_bytes) for g in job.cache_grants if g.cache_quota_bytes > 0}
    io = sum(g.remote_io_bytes_per_s for g in job.cache_grants)
    return Allocation(placement=placement, batch_size=job.batch_size, cache_bytes=grants,
                      remote_io_bytes_per_s=float(io) if io > 0 else math.inf, gpu_type=job.gpu_type)


def master_port(job_id: str, generation: int, taken: set[int] | frozenset[int] = frozenset()) -> int:
    """The rendezvous port of a (job, generation): its hash slot in the range, or the next one
    not in ``taken`` (the ports of the other jobs whose rank 0 is on the same node). A new
    generation gets a new port, so a re-formed group never meets a stale one."""
    if len(taken) >= MASTER_PORT_RANGE:
        raise ValueError(f"all {MASTER_PORT_RANGE} rendezvous ports of a node are taken")
    slot = zlib.crc32(f"{job_id}/{generation}".encode()) % MASTER_PORT_RANGE
    while MASTER_PORT_BASE + slot in taken:
        slot = (slot + 1) % MASTER_PORT_RANGE
    return MASTER_PORT_BASE + slot


def master_node(allocation: plan_pb2.JobAllocation) -> str:
    """The node of the job's rank 0 ("" when the job holds no GPUs)."""
    ranks = ranks_of(allocation)
    return ranks[0][0] if ranks else ""


def assign_master_ports(plan: plan_pb2.AllocationPlan, previous: Mapping[str, plan_pb2.JobAllocation],
                        placements: Mapping[str, Placement] | None = None) -> None:
    """Give every placed job of ``plan`` its rendezvous port: kept while its generation is the
    previous plan's, else a fresh one that no other job with rank 0 on that node uses.
    ``placements``: each job's normalized placement where the caller has it (rank 0 is on its
    first node), else it is read off the entry."""
    taken: dict[str, set[int]] = {}
    fresh = []
    for job in plan.jobs:
        if placements is not None:
            placement = placements[job.job_id]
            node = placement[0][0] if placement else ""
        else:
            node = master_node(job)
        if not node:
            job.master_port = 0
            continue
        old = previous.get(job.job_id)
        if old is not None and old.generation == job.generation and old.master_port:
            job.master_port = old.master_port
            taken.setdefault(node, set()).add(job.master_port)
        else:
            fresh.append((job, node))
    for job, node in fresh:
        ports = taken.setdefault(node, set())
        job.master_port = master_port(job.job_id, job.generation, ports)
        ports.add(job.master_port)


def ranks_of(allocation: plan_pb2.JobAllocation) -> list[tuple[str, int]]:
    """(node, gpu index) of every rank, in rank order: nodes by name, then GPU indices ascending."""
    return [(node, index) for node, indices in placement_of(allocation) for index in indices]


def job_nodes(allocation: plan_pb2.JobAllocation) -> list[str]:
    """Every node the job reads on or caches on, by name: its placements' and cache grants'."""
    nodes = {p.node for p in allocation.placements if p.gpu_indices}
    nodes.update(g.node for g in allocation.cache_grants if g.node)
    return sorted(nodes)


def host_of(address: str) -> str:
    host, sep, _ = address.rpartition(":")
    return host.strip("[]") if sep else address


_NODE_PLAN_VERSION = plan_pb2.NodePlan.DESCRIPTOR.fields_by_name["version"].number


def same_node_part(a: plan_pb2.NodePlan, b: plan_pb2.NodePlan) -> bool:
    """Whether two views of a node say the same thing, whatever plan versions they were cut from
    (every field but the version counts: tasks, cache quotas, replicas, loans, the epoch)."""
    def said(view: plan_pb2.NodePlan) -> list:
        return [(f.number, value) for f, value in view.ListFields() if f.number != _NODE_PLAN_VERSION]
    return said(a) == said(b)


def node_plan(
    plan: plan_pb2.AllocationPlan,
    node: str,
    specs: Mapping[str, common_pb2.JobSpec],
    agent_addresses: Mapping[str, str],
    cache_addresses: Mapping[str, str] | None = None,
) -> plan_pb2.NodePlan:
    """The part of ``plan`` that concerns ``node`` (see :func:`node_plans`)."""
    views = node_plans(plan, specs, agent_addresses, cache_addresses, nodes={node})
    return views.get(node) or plan_pb2.NodePlan(version=plan.version, node=node, epoch=plan.epoch)


def node_plans(
    plan: plan_pb2.AllocationPlan,
    specs: Mapping[str, common_pb2.JobSpec],
    agent_addresses: Mapping[str, str],
    cache_addresses: Mapping[str, str] | None = None,
    nodes: AbstractSet[str] | None = None,
    jobs: Iterable[plan_pb2.JobAllocation] | None = None,
) -> dict[str, plan_pb2.NodePlan]:
    """Every node's part of ``plan``, cut in one pass over its jobs (or the parts of ``nodes``
    only, from ``jobs``, the plan's entries that concern them, in the plan's order): one
    TaskAssignment per rank placed there, its cache quotas, replicas and loans. A node the plan
    gives nothing has no entry.

    A cache quota names the job's other nodes (GPUs or cache grants there) as its peers, with
    their cache servers' addresses from ``cache_addresses`` ("" if unknown: the cache server
    looks it up): a miss here is asked of their caches before the remote store."""
    views: dict[str, plan_pb2.NodePlan] = {}

    def view(node: str) -> plan_pb2.NodePlan:
        if node not in views:
            views[node] = plan_pb2.NodePlan(version=plan.version, node=node, epoch=plan.epoch)
        return views[node]

    for job in plan.jobs if jobs is None else jobs:
        ranks = ranks_of(job)
        spec = specs.get(job.job_id)
        if ranks and (nodes is None or any(n in nodes for n, _ in ranks)):
            first = ranks[0][0]
            # The advertised host of rank 0's agent: the address the other nodes reach it at.
            master_addr = host_of(agent_addresses.get(first, "")) or first
            nodes_in_order = list(dict.fromkeys(n for n, _ in ranks))
            port = job.master_port or master_port(job.job_id, job.generation)
            local: dict[str, int] = {}
            for rank_node, _ in ranks:
                local[rank_node] = local.get(rank_node, 0) + 1
            seen: dict[str, int] = {}
            for rank, (rank_node, index) in enumerate(ranks):
                if nodes is not None and rank_node not in nodes:
                    continue
                task = view(rank_node).tasks.add(
                    job_id=job.job_id, rank=rank, world_size=len(ranks), gpu_indices=[index],
                    master_addr=master_addr, master_port=port,
                    batch_size=job.batch_size, generation=job.generation, fast_resize=job.fast_resize,
                    local_rank=seen.get(rank_node, 0), local_world_size=local[rank_node],
                    group_rank=nodes_in_order.index(rank_node),
                )
                seen[rank_node] = seen.get(rank_node, 0) + 1
                if spec is not None:
                    task.spec.CopyFrom(spec)
        for grant in job.cache_grants:
            if not grant.node or (nodes is not None and grant.node not in nodes):
                continue
            quota = view(grant.node).cache_quotas.add(
                job_id=job.job_id, dataset=spec.dataset if spec is not None else "",
                cache_quota_bytes=grant.cache_quota_bytes, remote_io_bytes_per_s=grant.remote_io_bytes_per_s,
                cache_policy=job.cache_policy,
            )
            for peer in job_nodes(job):
                if peer != grant.node:
                    quota.peers.add(node=peer, cache_address=(cache_addresses or {}).get(peer, ""))
    for replica in plan.replicas:
        if nodes is None or replica.node in nodes:
            view(replica.node).replicas.append(replica)
    for loan in plan.loans:
        if nodes is None or loan.node in nodes:
            view(loan.node).loans.append(loan)
    return views
