"""Per-rank CPU and memory requests in the simulator's inputs: cluster fields, workload columns,
and a run that keeps every rank within its node's cores and memory."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scheduler.registry import get_policy
from simulator import SimClock, Simulator, SimulatorInputError, cluster_from_dict, load_cluster, load_workload, write_workload
from simulator.workload import parse_workload

GiB = 2**30
HEADER = "name,time,application,num_replicas,batch_size"


def test_cluster_cores_and_memory_per_node_and_per_entry(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n"
                    "  - {count: 2, gpus: 4, cpus: 16, memory_bytes: 64Gi}\n"
                    "  - {name: big, gpus: 8, cpus: 95.5, memory_bytes: 512 GB}\n"
                    "  - {name: old, gpus: 4}\n"
                    "cpus_per_node: 8\nmemory_bytes_per_node: 1.5Gi\n")
    nodes = load_cluster(path).nodes
    assert [(n.name, n.cpus, n.memory_bytes) for n in nodes] == [
        ("node-00", 16.0, 64 * GiB), ("node-01", 16.0, 64 * GiB), ("big", 95.5, 512e9), ("old", 8.0, 1.5 * GiB)]
    uniform = cluster_from_dict({"nodes": 2, "cpus_per_node": 32, "memory_bytes_per_node": "256 GiB"}).nodes
    assert {(n.cpus, n.memory_bytes) for n in uniform} == {(32.0, 256 * GiB)}


def test_absent_cores_and_memory_mean_no_limit():
    assert {(n.cpus, n.memory_bytes) for n in load_cluster(None).nodes} == {(math.inf, math.inf)}
    assert {(n.cpus, n.memory_bytes) for n in cluster_from_dict({"nodes": [{"gpus": 2}]}).nodes} == {(math.inf, math.inf)}
    assert cluster_from_dict({"nodes": 1, "cpus_per_node": ".inf"}).nodes[0].cpus == math.inf


@pytest.mark.parametrize("data, field", [
    ({"cpus_per_node": -1}, "'cpus_per_node': must be a number >= 0"),
    ({"cpus_per_node": "many"}, "'cpus_per_node': expected a number"),
    ({"memory_bytes_per_node": "1.5"}, "'memory_bytes_per_node': expected whole bytes"),
    ({"memory_bytes_per_node": "lots"}, "'memory_bytes_per_node': expected a number"),
    ({"nodes": [{"gpus": 4, "cpus": -2}]}, "'nodes[0]' field 'cpus'"),
    ({"nodes": [{"gpus": 4, "memory_bytes": "nan"}]}, "'nodes[0]' field 'memory_bytes'"),
    ({"nodes": [{"gpus": 4, "memory": 8}]}, "'nodes[0]': unknown field 'memory'"),
])
def test_bad_cores_and_memory_are_named(data, field):
    with pytest.raises(SimulatorInputError) as err:
        cluster_from_dict(data)
    assert field in str(err.value)


def test_workload_request_columns():
    jobs = parse_workload(f"{HEADER},cpus_per_rank,memory_bytes_per_rank\n"
                          "a,0,cifar10,2,128,2.5,8589934592\nb,1,ncf,1,256,,\nc,2,cifar10,1,128,0,4096\n", "w.csv")
    assert [(j.name, j.cpus_per_rank, j.memory_bytes_per_rank) for j in jobs] == [
        ("a", 2.5, 8 * GiB), ("b", 0, 0), ("c", 0, 4096)]
    # Either column alone; absent columns are no requests.
    assert parse_workload(f"{HEADER},memory_bytes_per_rank\na,0,cifar10,2,128,1024\n")[0].memory_bytes_per_rank == 1024
    plain = parse_workload(f"{HEADER}\na,0,cifar10,2,128\n")[0]
    assert (plain.cpus_per_rank, plain.memory_bytes_per_rank) == (0, 0)


@pytest.mark.parametrize("row, message", [
    ("a,0,cifar10,2,128,-1,", "row 2, column 'cpus_per_rank': expected CPU cores per rank (a number in 0..4096), got '-1'"),
    ("a,0,cifar10,2,128,lots,", "column 'cpus_per_rank'"),
    ("a,0,cifar10,2,128,nan,", "column 'cpus_per_rank'"),
    ("a,0,cifar10,2,128,5000,", "column 'cpus_per_rank'"),
    ("a,0,cifar10,2,128,,1.5", "row 2, column 'memory_bytes_per_rank': expected bytes per rank"),
    ("a,0,cifar10,2,128,,-4", "column 'memory_bytes_per_rank'"),
    ("a,0,cifar10,2,128,,8Gi", "column 'memory_bytes_per_rank'"),
])
def test_bad_request_cells_name_the_row_and_column(row, message):
    with pytest.raises(SimulatorInputError) as err:
        parse_workload(f"{HEADER},cpus_per_rank,memory_bytes_per_rank\n{row}\n", "w.csv")
    assert message in str(err.value)


def test_written_workloads_keep_their_requests(tmp_path: Path):
    jobs = parse_workload(f"{HEADER},cpus_per_rank,memory_bytes_per_rank\na,0,cifar10,2,128,0.5,1024\nb,3,ncf,1,256,,\n")
    write_workload(jobs, tmp_path / "w.csv")
    assert load_workload(tmp_path / "w.csv").jobs == jobs
    write_workload(parse_workload(f"{HEADER}\na,0,cifar10,2,128\n"), tmp_path / "plain.csv")
    assert (tmp_path / "plain.csv").read_text().splitlines()[0] == HEADER  # no request columns when none requests


@pytest.mark.parametrize("policy", ["fifo", "pollux"])
def test_a_run_keeps_every_rank_within_its_nodes_cores_and_memory(tmp_path: Path, policy: str):
    (tmp_path / "w.csv").write_text(
        f"{HEADER},cpus_per_rank,memory_bytes_per_rank\n"
        "heavy,0,cifar10,4,128,6,\nfat,10,cifar10,2,128,,40000000000\nplain,20,ncf,4,256,,\nlight,30,cifar10,2,128,1,1000000000\n")
    cluster = cluster_from_dict({"nodes": [{"count": 2, "gpus": 4, "cpus": 8, "memory_bytes": "32 GB"},
                                           {"count": 2, "gpus": 4, "cpus": 32, "memory_bytes": "128 GB"}]})
    sizes = {n.name: n for n in cluster.nodes}
    workload = load_workload(tmp_path / "w.csv")
    jobs = {j.name: j for j in workload.jobs}  # what the file asks for, not what the engine passed on
    seen: dict[str, set[str]] = {}

    def watch(snapshot, plan):
        for job_id, alloc in plan.allocations.items():
            for node, ix in alloc.placement:
                assert len(ix) * jobs[job_id].cpus_per_rank <= sizes[node].cpus
                assert len(ix) * jobs[job_id].memory_bytes_per_rank <= sizes[node].memory_bytes
                seen.setdefault(job_id, set()).add(node)

    result = Simulator(workload, get_policy(policy), cluster, clock=SimClock(0.0), on_round=watch,
                       check_invariants=False).run()  # the watch checks what the invariants would
    assert len(result.jobs) == 4 and all(math.isfinite(j.jct_s) for j in result.jobs)
    assert seen["fat"] <= {"node-02", "node-03"}  # 40 GB a rank: the big nodes only
