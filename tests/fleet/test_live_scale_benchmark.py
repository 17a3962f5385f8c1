"""benchmarks/live_scale.py end to end at a toy size: real metadata and scheduler processes and a
fleet of a few nodes, with the scheduler on a CPU of its own; the figures it writes are the ones
docs/sizing.md tabulates."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import live_scale  # noqa: E402


def test_live_scale_runs_a_small_cluster_and_reports_each_target(tmp_path: Path, capsys) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--pin-scheduler needs 2 CPUs")  # CI and this machine have 2
    out = tmp_path / "r.json"
    cpus = os.sched_getaffinity(0)
    assert live_scale.main(["--nodes", "4", "--jobs", "24", "--measure-jobs", "12", "--measure-s", "3",
                            "--task-seconds", "1", "--interval-s", "0.5", "--steady-jobs", "6", "--steady-after-s", "1", "--heartbeat-s", "1", "--report-s", "1",
                            "--pin-scheduler", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "scheduler alone on CPU" in printed
    for target in ("round (fifo)", "plan to every node it changed acked", "submissions while the nodes join",
                   "submissions in steady running"):
        assert target in printed and ("MET" in printed or "MISSED" in printed)
    [result] = json.loads(out.read_text())
    assert result["submissions_measured"] == 12 and result["submissions_per_s"] > 0
    assert result["scheduler_cpus"] == [min(os.sched_getaffinity(0))]
    assert os.sched_getaffinity(0) == cpus  # the benchmark gave its own process its CPUs back
    assert result["rounds_all"]["rounds"] >= 1 and result["acks"]["plans_fully_acked"] >= 1
    assert result["steady_submissions"]["jobs"] == 6 and result["steady_submissions"]["per_s"] > 0
    assert sum(result["jobs_at_end"].values()) == 24 + 6
    assert set(result["cpu_cores"]) == {"scheduler", "metadata", "fleet"}
    # Both services' loop probes ran through the measured span (one every 0.1 s, several seconds).
    assert all(result["event_loop_lag"][k]["probes"] >= 10 for k in ("scheduler", "metadata"))
    assert result["scheduler_gc"]["seconds"] >= 0 and "event loop lag" in printed
    table = live_scale.table([str(out)])
    assert "scheduler on a CPU of its own" in table and "| fifo |" in table


def test_live_scale_with_the_allocation_service(tmp_path: Path) -> None:
    """--allocation: the fleet's nodes watch, ack and report at the allocation service, as deployed."""
    out = tmp_path / "r.json"
    assert live_scale.main(["--nodes", "4", "--jobs", "24", "--measure-jobs", "12", "--measure-s", "3",
                            "--task-seconds", "1", "--interval-s", "0.5", "--steady-jobs", "0", "--heartbeat-s", "1",
                            "--report-s", "1", "--allocation", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    assert result["allocation_service"] and set(result["cpu_cores"]) == {"scheduler", "metadata", "fleet", "allocation"}
    assert result["acks"]["plans_fully_acked"] >= 1 and result["jobs_at_end"]["succeeded"] >= 1


def test_live_scale_refuses_bad_flags_naming_them(capsys) -> None:
    for flags, named in ((["--task-spread", "1.5"], "--task-spread"), (["--steady-jobs", "-1"], "--steady-jobs")):
        try:
            live_scale.main(flags)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{flags} accepted")
        assert named in capsys.readouterr().err
