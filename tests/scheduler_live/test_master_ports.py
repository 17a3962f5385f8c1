"""Rendezvous ports: unique among the jobs whose rank 0 shares a node, kept within a generation."""

from __future__ import annotations

import itertools
import zlib

from scheduler.live import convert
from silod.v1 import plan_pb2


def _colliding_ids() -> tuple[str, str]:
    """Two job ids whose generation-1 hash slots are the same port."""
    seen: dict[int, str] = {}
    for i in itertools.count():
        job = f"job-{i:012x}"
        slot = zlib.crc32(f"{job}/1".encode()) % convert.MASTER_PORT_RANGE
        if slot in seen:
            return seen[slot], job
        seen[slot] = job
    raise AssertionError("unreachable")


def _plan(*jobs: tuple[str, str, int]) -> plan_pb2.AllocationPlan:
    plan = plan_pb2.AllocationPlan(version=1)
    for job_id, node, generation in jobs:
        entry = plan.jobs.add(job_id=job_id, generation=generation)
        entry.placements.add(node=node, gpu_indices=[0])
    return plan


def test_jobs_whose_hashes_collide_on_one_node_get_different_ports() -> None:
    a, b = _colliding_ids()
    plan = _plan((a, "n0", 1), (b, "n0", 1))
    convert.assign_master_ports(plan, {})
    ports = [j.master_port for j in plan.jobs]
    assert len(set(ports)) == 2 and all(convert.MASTER_PORT_BASE <= p < convert.MASTER_PORT_BASE + 1000 for p in ports)
    other_nodes = _plan((a, "n0", 1), (b, "n1", 1))
    convert.assign_master_ports(other_nodes, {})
    assert other_nodes.jobs[0].master_port == other_nodes.jobs[1].master_port, "different nodes may share a port"


def test_a_port_is_kept_while_the_generation_is_and_node_plans_carry_it() -> None:
    a, b = _colliding_ids()
    first = _plan((a, "n0", 1))
    convert.assign_master_ports(first, {})
    # b arrives with the same hash slot: a keeps its port, b takes the next free one.
    second = _plan((b, "n0", 1), (a, "n0", 1))
    convert.assign_master_ports(second, {j.job_id: j for j in first.jobs})
    ports = {j.job_id: j.master_port for j in second.jobs}
    assert ports[a] == first.jobs[0].master_port and ports[b] != ports[a]
    view = convert.node_plan(second, "n0", {}, {"n0": "198.18.0.5:7000"})
    assert {(t.job_id, t.master_port, t.master_addr) for t in view.tasks} == {
        (a, ports[a], "198.18.0.5"), (b, ports[b], "198.18.0.5")}
    unplaced = plan_pb2.AllocationPlan(version=3)
    unplaced.jobs.add(job_id=a, generation=1)
    convert.assign_master_ports(unplaced, {})
    assert unplaced.jobs[0].master_port == 0
