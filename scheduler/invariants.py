"""Checks every plan must pass, in tests, in every simulated round and before a live commit.

Among them: no node's cores or memory requested beyond what it has, summed over the ranks of the
jobs placed there that request them (``JobInfo.cpus_per_rank``, ``memory_bytes_per_rank``)."""

from __future__ import annotations

import math

from scheduler.policy import ClusterSnapshot, Plan

# Rounding slack for float sums of bytes and bytes/s.
_TOLERANCE = 1e-6


class PlanViolation(AssertionError):
    """A plan breaks an invariant; the message lists every problem found."""


def plan_problems(snapshot: ClusterSnapshot, plan: Plan) -> list[str]:
    """Every broken invariant of ``plan`` under ``snapshot`` (empty when the plan is sound)."""
    problems: list[str] = []
    nodes = {node.name: node for node in snapshot.nodes}
    jobs = {job.job_id: job for job in snapshot.jobs}
    holder: dict[tuple[str, int], str] = {}
    cache_use: dict[str, float] = {}
    nic_use: dict[str, float] = {}  # a job reads through its nodes' NICs in proportion to its GPUs there
    requested: dict[str, list] = {}  # node -> [cores, bytes, jobs] that ranks with requests ask of it
    io_total = 0.0
    for job_id, allocation in plan.allocations.items():
        job = jobs.get(job_id)
        if job is None:
            problems.append(f"{job_id}: not an active job")
            continue
        gpus = allocation.gpus
        if gpus and not job.min_gpus <= gpus <= job.max_gpus:
            problems.append(f"{job_id}: {gpus} GPUs outside [{job.min_gpus}, {job.max_gpus}]")
        for node_name, indices in allocation.placement:
            node = nodes.get(node_name)
            if node is None:
                problems.append(f"{job_id}: unknown node {node_name}")
                continue
            for index in indices:
                if not 0 <= index < node.gpus:
                    problems.append(f"{job_id}: GPU {node_name}:{index} does not exist")
                elif (node_name, index) in holder:
                    problems.append(f"{job_id}: GPU {node_name}:{index} already held by {holder[(node_name, index)]}")
                else:
                    holder[(node_name, index)] = job_id
        if job.cpus_per_rank or job.memory_bytes_per_rank:
            for node_name, indices in allocation.placement:
                if indices and node_name in nodes:
                    entry = requested.setdefault(node_name, [0.0, 0.0, []])
                    entry[0] += len(indices) * job.cpus_per_rank
                    entry[1] += len(indices) * job.memory_bytes_per_rank
                    entry[2].append(job_id)
        if allocation.batch_size < 0:
            problems.append(f"{job_id}: negative batch size {allocation.batch_size}")
        for node_name, quota in allocation.cache_bytes.items():
            if not quota >= 0:  # also NaN, which every comparison below would let through
                problems.append(f"{job_id}: negative or NaN cache quota on {node_name}")
                continue
            cache_use[node_name] = cache_use.get(node_name, 0.0) + quota
        if not allocation.remote_io_bytes_per_s >= 0:
            problems.append(f"{job_id}: negative or NaN remote IO rate")
        elif math.isfinite(allocation.remote_io_bytes_per_s):
            io_total += allocation.remote_io_bytes_per_s
            for node_name, indices in allocation.placement:
                if gpus and indices:
                    nic_use[node_name] = nic_use.get(node_name, 0.0) + allocation.remote_io_bytes_per_s * len(indices) / gpus
    for node_name, used in cache_use.items():
        node = nodes.get(node_name)
        if node is None:
            problems.append(f"cache quota on unknown node {node_name}")
        elif used > node.cache_capacity_bytes * (1 + _TOLERANCE) + _TOLERANCE:
            problems.append(f"node {node_name}: cache quotas {used:.0f} B exceed capacity {node.cache_capacity_bytes:.0f} B")
    for node_name, (cpus, memory, holders) in requested.items():
        node = nodes[node_name]
        for resource, used, capacity, shown in (("cores", cpus, node.cpus, "{:g}"), ("memory", memory, node.memory_bytes, "{:.0f} B")):
            if used > capacity * (1 + _TOLERANCE) + _TOLERANCE:
                problems.append(f"node {node_name}: {resource} requested by the ranks of {', '.join(holders)} "
                                f"({shown.format(used)}) exceed its {shown.format(capacity)}")
    for node_name, used in nic_use.items():
        node = nodes.get(node_name)
        if node is not None and math.isfinite(node.nic_bytes_per_s) and used > node.nic_bytes_per_s * (1 + _TOLERANCE) + _TOLERANCE:
            problems.append(f"node {node_name}: remote IO rates {used:.0f} B/s exceed its NIC {node.nic_bytes_per_s:.0f} B/s")
    budget = snapshot.storage_bandwidth_bytes_per_s
    if math.isfinite(budget) and io_total > budget * (1 + _TOLERANCE) + _TOLERANCE:
        problems.append(f"remote IO rates {io_total:.0f} B/s exceed the storage budget {budget:.0f} B/s")
    return problems


def check_plan(snapshot: ClusterSnapshot, plan: Plan) -> None:
    """Raise :class:`PlanViolation` listing every problem, if any."""
    problems = plan_problems(snapshot, plan)
    if problems:
        raise PlanViolation("; ".join(problems))
