"""The whole Philly trace as a workload: every job at its own arrival time and GPU count."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from simulator import SimulatorInputError, load_workload
from silod.cli.main import main
from simulator.philly import APPLICATION_BY_GPU_HOURS, read_trace, replay_philly, trace_jobs, trace_shape
from simulator.workload import parse_workload


def test_replay_holds_every_job_at_its_own_time_and_gpus():
    jobs = replay_philly()
    trace = trace_jobs()
    assert len(jobs) == len(read_trace()) == 82_247
    assert jobs[0].arrival_s == 0.0
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    assert [j.arrival_s for j in jobs] == [t.submit_s - trace[0].submit_s for t in trace]
    assert 108 < jobs[-1].arrival_s / 86400 < 109
    assert [j.name for j in jobs[:2]] == [f"{jobs[0].application}-0", f"{jobs[1].application}-1"]
    for job, row in zip(jobs, trace):
        bound = next(b for b, apps in APPLICATION_BY_GPU_HOURS if row.gpu_hours < b)
        assert job.application in dict(APPLICATION_BY_GPU_HOURS)[bound]
        assert 1 <= job.num_replicas <= row.num_gpus
    assert max(j.num_replicas for j in jobs) == 128  # 128-GPU jobs keep their GPUs (imagenet allows 640)
    assert sum(j.num_replicas == 1 for j in jobs) == 76_627


def test_replay_is_deterministic_and_seeded():
    a, b, c = replay_philly(0), replay_philly(0), replay_philly(1)
    assert a == b
    assert [j.application for j in a] != [j.application for j in c]
    assert [j.arrival_s for j in a] == [j.arrival_s for j in c]


def test_one_virtual_cluster_and_filters():
    vc = replay_philly(cluster="6214e9")
    assert len(vc) == 41_226 and vc[0].arrival_s == 0.0
    with pytest.raises(SimulatorInputError, match="virtual cluster 'nope'"):
        replay_philly(cluster="nope")
    filtered = replay_philly(min_duration_s=60, max_gpu_hours=1000)
    assert len(filtered) == 82_247 - 7_654 - 165 + sum(
        1 for t in read_trace() if t.duration_s < 60 and t.gpu_hours >= 1000)
    assert max(j.num_replicas for j in replay_philly(max_gpus=8)) == 8


def test_workload_names_and_cli(tmp_path: Path):
    whole = load_workload("philly")
    assert whole.name == "philly" and len(whole) == 82_247
    assert len(load_workload("philly/ee9e8c")) == 1_511
    out = tmp_path / "vc.csv"
    assert main(["simulate", "generate", "--philly", "--replay", "--vc", "ee9e8c", "--out", str(out)]) == 0
    assert parse_workload(out.read_text()) == load_workload("philly/ee9e8c").jobs
    assert main(["simulate", "generate", "--philly", "--out", str(out)]) == 2       # neither --jobs nor --replay
    assert main(["simulate", "generate", "--philly", "--replay", "--jobs", "5", "--out", str(out)]) == 2


def test_trace_shape():
    shape = trace_shape()
    assert shape.jobs == 82_247
    assert shape.first_submit == "2017-09-04 10:30:41" and shape.last_submit == "2017-12-22 08:02:11"
    assert 108 < shape.days < 109
    assert math.isclose(shape.mean_busy_gpus, 374.2, abs_tol=0.1)
    assert dict(shape.gpus_per_job)[128] == 3
    assert sum(w[1] for w in shape.weeks) == shape.jobs
    assert shape.peak_busy_gpus == max(w[3] for w in shape.weeks)


def test_shape_command_prints_the_totals_and_a_row_a_week(capsys):
    assert main(["simulate", "shape", "--philly"]) == 0
    text = capsys.readouterr().out
    shape = trace_shape()
    assert "82,247 jobs submitted 2017-09-04 10:30:41 to 2017-12-22 08:02:11 (108.9 days)" in text
    assert "374 on average" in text and f"{shape.peak_busy_gpus:,} at the peak" in text
    assert text.count("\n| 2017-") == len(shape.weeks) == 16
    assert main(["simulate", "shape", "--philly", "--vc", "ee9e8c"]) == 0
    assert "Philly virtual cluster ee9e8c:" in capsys.readouterr().out
    assert main(["simulate", "shape", "--philly", "--vc", "nope"]) == 2
    assert "'nope': not in the trace" in capsys.readouterr().err
