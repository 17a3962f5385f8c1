"""Typed cluster specs in the simulator: YAML, and jobs running at their type's speed."""

from __future__ import annotations

import pytest

from estimator.gpu_types import application_speed
from simulator import SimulatorInputError, Simulator, cluster_from_dict
from simulator.workload import JobSpec


def test_typed_nodes_from_yaml_entries_and_a_cluster_wide_default():
    spec = cluster_from_dict({"nodes": [{"count": 2, "gpus": 4, "gpu_type": "v100"}, {"count": 1, "gpus": 8}], "gpu_type": "k80"})
    assert [n.gpu_type for n in spec.nodes] == ["v100", "v100", "k80"]
    assert spec.gpu_types == ("k80", "v100")
    assert spec.describe()["gpus_by_type"] == {"k80": 8, "v100": 8}
    assert {n.gpu_type for n in cluster_from_dict({"nodes": 2, "gpu_type": "a100"}).nodes} == {"a100"}
    assert cluster_from_dict({"nodes": 2}).gpu_types == ("",)


@pytest.mark.parametrize("data", [
    {"nodes": [{"gpus": 4, "gpu_type": "V100"}]},
    {"nodes": [{"gpus": 4, "gpu_type": 100}]},
    {"nodes": 2, "gpu_type": "a 100"},
])
def test_bad_gpu_types_are_named(data):
    with pytest.raises(SimulatorInputError, match="'gpu_type'"):
        cluster_from_dict(data)


def run_alone(gpu_type: str) -> float:
    cluster = cluster_from_dict({"nodes": [{"count": 1, "gpus": 4, "gpu_type": gpu_type}], "restart_cost_s": 0})
    short = JobSpec("a", "imagenet", 0.0, 1, 200, target_samples=2e6)  # hours, not days, of simulated time
    return Simulator([short], "fifo", cluster).run().jobs[0].jct_s


def test_a_job_runs_at_its_types_measured_speed():
    # One GPU, no restart cost: JCT is the job's work over its compute rate, so the ratio of
    # JCTs is the inverse of the measured speed ratio, rounded only by the 60 s rounds.
    v100, k80 = run_alone("v100"), run_alone("k80")
    assert k80 / v100 == pytest.approx(1 / application_speed("imagenet", "k80"), rel=0.02)


def test_the_scheduler_prefers_the_fast_type_and_allocations_name_it():
    cluster = cluster_from_dict({"nodes": [{"count": 1, "gpus": 4, "gpu_type": "k80"},
                                           {"count": 1, "gpus": 4, "gpu_type": "v100"}]})
    seen = []
    sim = Simulator([JobSpec("a", "imagenet", 0.0, 4, 200, target_samples=2e6)], "fifo", cluster,
                    observer=lambda p: seen.append([j.allocation for j in sim._active if j.allocation]))
    sim.run()
    allocations = [a for round_ in seen for a in round_]
    assert allocations and {a.gpu_type for a in allocations} == {"v100"}


def test_silod_up_reads_the_same_typed_cluster_yaml(tmp_path):
    import argparse

    from silod.cli.up import _node_layout

    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n  - {count: 2, gpus: 4, gpu_type: v100}\n  - {count: 1, gpus: 2, gpu_type: k80, pool: inference}\n")
    args = argparse.Namespace(cluster=str(path), gpu_type="", nodes=9, gpus_per_node=9, inference_nodes=9)
    assert _node_layout(args) == [("training", "node-00", 4, "v100"), ("training", "node-01", 4, "v100"),
                                  ("inference", "node-02", 2, "k80")]
    flags = argparse.Namespace(cluster="", gpu_type="a100", nodes=2, gpus_per_node=1, inference_nodes=1)
    assert _node_layout(flags) == [("training", "node-0", 1, "a100"), ("training", "node-1", 1, "a100"),
                                   ("inference", "infer-0", 1, "a100")]
    path.write_text("nodes:\n  - {count: 2, gpus: 4, gpu_type: V100}\n")
    with pytest.raises(ValueError, match="--cluster: .*'gpu_type'"):
        _node_layout(args)
    with pytest.raises(ValueError, match="gpu_type"):
        _node_layout(argparse.Namespace(cluster="", gpu_type="A 100", nodes=1, gpus_per_node=1, inference_nodes=0))


def test_gavel_traces_load_with_their_job_types_and_v100_durations():
    from estimator.gpu_types import measured_steps_per_s
    from simulator.gavel_trace import _one_gpu_goodput, application_of, parse_gavel_trace
    from simulator.loading import load_workload

    workload = load_workload("gavel/msr-seed0-0e4a51")
    assert len(workload) == 1181 and {j.num_replicas for j in workload.jobs} == {1, 2, 4, 8}
    first = next(j for j in workload.jobs if j.job_type == "ResNet-50 (batch size 128)")
    assert first.application == application_of(first.job_type) == "imagenet"
    text = "job_type,total_steps,arrival_s,scale_factor\nCycleGAN,4426,10.0,2\n"
    (job,) = parse_gavel_trace(text)
    # 4,426 steps at Gavel's 4.43 steps/s on a V100: 1,000 s on one V100 at the stand-in's goodput.
    seconds = job.target_samples / _one_gpu_goodput("yolov3")
    assert seconds == pytest.approx(4426 / measured_steps_per_s()["CycleGAN"]["v100"])
    assert (job.application, job.num_replicas, job.arrival_s) == ("yolov3", 2, 10.0)
    for bad, message in [("Nope,1,0,1", "unknown Gavel job type"), ("CycleGAN,0,0,1", ">= 1"), ("CycleGAN,x,0,1", "whole")]:
        with pytest.raises(SimulatorInputError, match=message):
            parse_gavel_trace("job_type,total_steps,arrival_s,scale_factor\n" + bad + "\n")
    with pytest.raises(SimulatorInputError, match="no such Gavel trace"):
        load_workload("gavel/none")


def test_the_measured_gavel_trace_is_the_full_one_without_its_unmeasured_multi_gpu_jobs():
    # What Gavel's own simulator can run: no multi-GPU A3C, CycleGAN or Recommendation job
    # (its throughput table has none), every other row unchanged (evaluation.md, (a)).
    from simulator.loading import load_workload

    full = load_workload("gavel/msr-seed0-0e4a51").jobs
    measured = load_workload("gavel/msr-seed0-0e4a51-measured").jobs
    unmeasured = ("A3C", "CycleGAN", "Recommendation")
    kept = [j for j in full if not (j.num_replicas > 1 and j.job_type.split(" (")[0] in unmeasured)]
    assert len(measured) == len(kept) == 984
    strip = lambda j: (j.job_type, j.num_replicas, j.arrival_s, j.target_samples)  # noqa: E731
    assert [strip(j) for j in measured] == [strip(j) for j in kept]
