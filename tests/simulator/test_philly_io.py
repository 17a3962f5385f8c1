"""The IO-bound Philly mix and the packaged scenario built from it (docs/evaluation.md,
"Co-design: cache and remote IO", "A Philly workload that reads its data")."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from simulator import SimulatorInputError, generate_philly, load_cluster, load_workload, write_workload
from simulator.philly import application_for

ROOT = Path(__file__).resolve().parents[2]


def test_io_mix_maps_gpu_hours_to_image_and_speech_applications():
    rng = random.Random(0)
    assert {application_for(0.5, rng, "io") for _ in range(50)} == {"cifar10"}
    assert {application_for(5.0, rng, "io") for _ in range(200)} == {"deepspeech2", "yolov3"}
    assert application_for(50.0, rng, "io") == "yolov3"
    assert application_for(500.0, rng, "io") == "imagenet"
    # the default mix is unchanged (the Pollux artifact's)
    assert {application_for(5.0, rng) for _ in range(200)} == {"deepspeech2", "bert"}


def test_io_mix_keeps_arrivals_and_gpus_of_the_default_mix():
    default = generate_philly(64, 0)
    io = generate_philly(64, 0, mix="io")
    assert {j.application for j in io} <= {"cifar10", "yolov3", "deepspeech2", "imagenet"}
    # the same Philly jobs are sampled: same arrivals; the application may change the GPU cap
    assert sorted(j.arrival_s for j in default) == sorted(j.arrival_s for j in io)


def test_unknown_mix_is_refused():
    with pytest.raises(SimulatorInputError, match="mix"):
        generate_philly(10, 0, mix="nlp")


def test_packaged_philly_io_workload_is_the_generator_output(tmp_path: Path):
    out = tmp_path / "w.csv"
    write_workload(generate_philly(64, 0, mix="io"), out)
    packaged = ROOT / "simulator/workloads/workloads-philly-io/workload-0.csv"
    assert out.read_bytes() == packaged.read_bytes()
    assert len(load_workload("workloads-philly-io/workload-0")) == 64


def test_io_bound_philly_cluster():
    cluster = load_cluster(ROOT / "simulator/clusters/io-bound-philly.yaml")
    assert len(cluster.nodes) == 8 and cluster.gpus_per_node == 4
    assert all(n.cache_capacity_bytes == 32e9 for n in cluster.nodes)
    assert cluster.storage_bandwidth_bytes_per_s == 40e6


def test_max_gpu_hours_caps_the_sampled_jobs():
    capped = generate_philly(64, 0, mix="io", max_gpu_hours=100)
    assert "imagenet" not in {j.application for j in capped}  # imagenet is the >= 100 GPU-hour bucket
    with pytest.raises(SimulatorInputError, match="max-gpu-hours"):
        generate_philly(10, 0, max_gpu_hours=0)
    with pytest.raises(SimulatorInputError, match="max-gpu-hours"):
        generate_philly(10, 0, max_gpu_hours=5000)


def test_generate_cli_takes_the_mix_and_the_cap(tmp_path: Path):
    from silod.cli.main import main

    out = tmp_path / "w.csv"
    assert main(["simulate", "generate", "--philly", "--jobs", "64", "--seed", "0", "--mix", "io",
                 "--max-gpu-hours", "100", "--out", str(out)]) == 0
    expected = tmp_path / "e.csv"
    write_workload(generate_philly(64, 0, mix="io", max_gpu_hours=100), expected)
    assert out.read_bytes() == expected.read_bytes()


def test_packaged_storage_bound_workload_is_the_generator_output(tmp_path: Path):
    out = tmp_path / "w.csv"
    write_workload([j for j in generate_philly(64, 0, mix="io", load=2) if j.application != "imagenet"], out)
    packaged = ROOT / "simulator/workloads/workloads-philly-io/workload-1.csv"
    assert out.read_bytes() == packaged.read_bytes()
    assert len(load_workload("workloads-philly-io/workload-1")) == 63
    cluster = load_cluster(ROOT / "simulator/clusters/storage-bound-philly.yaml")
    assert len(cluster.nodes) == 8 and all(n.cache_capacity_bytes == 1e9 for n in cluster.nodes)
    assert cluster.storage_bandwidth_bytes_per_s == 7e6
