"""Workload CSVs, packaged data, cluster YAML and the Philly generator."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from simulator import SimulatorInputError, cluster_from_dict, generate_philly, load_cluster, load_workload, packaged_workloads, write_workload
from simulator.philly import read_trace
from simulator.workload import parse_workload

HEADER = "name,time,application,num_replicas,batch_size\n"


def test_every_packaged_pollux_workload_loads():
    pollux = {"workloads", "workloads-0.5", "workloads-1.5", "workloads-2.0", "workloads-realistic"}
    names = [n for n in packaged_workloads() if n.split("/")[0] in pollux]  # other dirs (deepboot, philly-io) are silod's own
    dirs = {name.split("/")[0] for name in names}
    assert dirs == pollux
    assert len(names) == 40
    sizes = {d: len(load_workload(f"{d}/workload-1")) for d in dirs}
    assert sizes == {"workloads": 160, "workloads-0.5": 80, "workloads-1.5": 240, "workloads-2.0": 320, "workloads-realistic": 160}


def test_packaged_deepboot_workload_is_workload_6_plus_inference_tasks():
    mixed = load_workload("workloads-deepboot/workload-6-diurnal")
    assert mixed.jobs == load_workload("workload-6").jobs
    assert len(mixed.inference) > 1000 and all(t.application.startswith("infer-") for t in mixed.inference)


@pytest.mark.parametrize("spelling", ["workload-6", "workloads/workload-6", "workloads/workload-6.csv", " workload-6 "])
def test_packaged_names(spelling):
    workload = load_workload(spelling)
    assert workload.name == "workloads/workload-6"
    first = workload.jobs[0]
    assert (first.name, first.arrival_s, first.application, first.num_replicas, first.batch_size) == ("cifar10-0", 53.0, "cifar10", 6, 2048)


def test_a_path_wins_and_jobs_are_sorted_by_arrival(tmp_path: Path):
    path = tmp_path / "w.csv"
    path.write_text(HEADER + "late,100,ncf,1,32768\nearly,5,cifar10,2,256\n")
    workload = load_workload(path)
    assert [j.name for j in workload.jobs] == ["early", "late"]
    assert workload.name == str(path)


@pytest.mark.parametrize("body, message", [
    ("", "empty file"),
    ("name,time,application,num_replicas\n", "header lacks column 'batch_size'"),
    (HEADER, "no jobs"),
    (HEADER + "a,10,cifar10,2,256\nb,x,cifar10,2,256\n", "row 3, column 'time': expected seconds"),
    (HEADER + "a,-1,cifar10,2,256\n", "row 2, column 'time'"),
    (HEADER + "a,10,resnet,2,256\n", "row 2, column 'application': expected one of bert, cifar10"),
    (HEADER + "a,10,cifar10,0,256\n", "row 2, column 'num_replicas': expected a whole number >= 1, got '0'"),
    (HEADER + "a,10,cifar10,1.5,256\n", "row 2, column 'num_replicas'"),
    (HEADER + "a,10,cifar10,2,\n", "row 2, column 'batch_size'"),
    (HEADER + "a,10,cifar10,2\n", "row 2: 4 fields, the header has 5"),
    (HEADER + "a,10,cifar10,2,256\na,20,ncf,1,256\n", "row 3, column 'name': job 'a' already defined in row 2"),
])
def test_malformed_workloads_name_the_row_and_column(body, message):
    with pytest.raises(SimulatorInputError, match="^workload w.csv: .*" if message else None) as err:
        parse_workload(body, "w.csv")
    assert message in str(err.value)


def test_missing_workload_says_what_it_tried(tmp_path: Path):
    with pytest.raises(SimulatorInputError, match="no such file, and not a packaged workload"):
        load_workload(tmp_path / "absent.csv")
    with pytest.raises(SimulatorInputError, match="is a directory"):
        load_workload(tmp_path)


def test_cluster_defaults_are_the_pollux_artifacts():
    spec = load_cluster(None)
    assert (len(spec.nodes), spec.total_gpus, spec.interval_s, spec.restart_cost_s) == (16, 64, 60.0, 30.0)
    assert spec.job_gpu_cap == 64 and not spec.schedule_on_events


def test_cluster_yaml_forms(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - {count: 2, gpus: 4}\n  - {name: big, gpus: 8}\nrestart_cost_s: 10\ninterval_s: 30\nmax_gpus_per_job: 8\n")
    spec = load_cluster(path)
    assert [(n.name, n.gpus) for n in spec.nodes] == [("node-00", 4), ("node-01", 4), ("big", 8)]
    assert (spec.restart_cost_s, spec.interval_s, spec.job_gpu_cap) == (10.0, 30.0, 8)
    assert cluster_from_dict({"nodes": 3, "gpus_per_node": 2}).total_gpus == 6


@pytest.mark.parametrize("data, field", [
    ({"nodes": 0}, "'nodes'"),
    ({"nodes": "many"}, "'nodes'"),
    ({"gpus_per_node": 1.5}, "'gpus_per_node'"),
    ({"interval_s": 0}, "'interval_s'"),
    ({"restart_cost_s": -1}, "'restart_cost_s'"),
    ({"restart_cost_s": "30s"}, "'restart_cost_s'"),
    ({"schedule_on_events": "yes"}, "'schedule_on_events'"),
    ({"max_gpus_per_job": 0}, "'max_gpus_per_job'"),
    ({"nodes": [{"count": 2}]}, "'nodes[0]': field 'gpus' is required"),
    ({"nodes": [{"gpus": 4, "colour": "red"}]}, "'nodes[0]': unknown field 'colour'"),
    ({"nodes": [{"gpus": 4, "name": "a"}, {"gpus": 4, "name": "a"}]}, "'a' appears twice"),
    ({"nodez": 3}, "unknown field 'nodez'"),
])
def test_bad_cluster_fields_are_named(data, field):
    with pytest.raises(SimulatorInputError, match="cluster") as err:
        cluster_from_dict(data)
    assert field in str(err.value)


def test_cluster_file_errors(tmp_path: Path):
    with pytest.raises(SimulatorInputError, match="no such file"):
        load_cluster(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1, 2\n")
    with pytest.raises(SimulatorInputError, match="not valid YAML"):
        load_cluster(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(SimulatorInputError, match="expected a mapping"):
        load_cluster(bad)


def test_philly_generator_is_deterministic_per_seed(tmp_path: Path):
    a, b, c = (tmp_path / n for n in ("a.csv", "b.csv", "c.csv"))
    write_workload(generate_philly(160, seed=7), a)
    write_workload(generate_philly(160, seed=7), b)
    write_workload(generate_philly(160, seed=8), c)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    workload = load_workload(a)  # the generated CSV reads back as a workload
    assert len(workload) == 160


def test_philly_mapping_and_load():
    jobs = generate_philly(200, seed=1, hours=8)
    assert all(0 <= j.arrival_s < 8 * 3600 for j in jobs)
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    assert {j.application for j in jobs} <= {"cifar10", "ncf", "deepspeech2", "bert", "yolov3", "imagenet"}
    assert {"cifar10", "ncf"} <= {j.application for j in jobs}  # most Philly jobs are under a GPU-hour
    assert all(1 <= j.num_replicas <= 64 for j in jobs)
    assert [j.name for j in jobs][:2] == [f"{jobs[0].application}-0", f"{jobs[1].application}-1"]
    doubled = generate_philly(200, seed=1, hours=8, load=2.0)
    assert [j.arrival_s for j in doubled] == sorted(float(round(j.arrival_s / 2.0)) for j in jobs)


def test_philly_trace_is_packaged_whole():
    trace = read_trace()
    assert len(trace) > 82_000
    with pytest.raises(SimulatorInputError, match="--jobs"):
        generate_philly(0)


def test_generated_csv_has_the_pollux_columns(tmp_path: Path):
    path = tmp_path / "g.csv"
    write_workload(generate_philly(5, seed=3), path)
    with path.open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["name", "time", "application", "num_replicas", "batch_size"]
    assert len(rows) == 6
