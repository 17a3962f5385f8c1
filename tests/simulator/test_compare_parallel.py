"""simulate compare runs its simulations in parallel processes (--jobs), results in the order asked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from silod.cli.main import main
from simulator.parallel import Board, Run, run_many


def compare(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    assert main(["simulate", "compare", "--workload", "workload-6", "--policy", "tiresias,fifo,sjf", "--no-plots",
                 "--quiet", "--out", str(out), *extra]) == 0
    data = json.loads((out / "compare.json").read_text())
    return data


def test_parallel_runs_give_the_sequential_results_in_the_order_asked(tmp_path: Path, capsys):
    sequential = compare(tmp_path, "one", "--jobs", "1")
    parallel = compare(tmp_path, "two", "--jobs", "2")
    strip = lambda rows: {p: {k: v for k, v in row.items() if k != "wall_time_s"} for p, row in rows.items()}  # noqa: E731
    assert list(parallel["policies"]) == ["tiresias", "fifo", "sjf"]
    assert strip(parallel["policies"]) == strip(sequential["policies"])
    assert capsys.readouterr().err == ""  # no progress when stderr is not a terminal


def test_jobs_must_be_positive(tmp_path: Path, capsys):
    assert main(["simulate", "compare", "--workload", "workload-6", "--policy", "fifo", "--jobs", "0",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--jobs" in capsys.readouterr().err


def _fails(observer):
    raise ValueError("run two failed")


def _sleeps(observer):
    import time

    time.sleep(0.2)
    return os.getpid()


def test_a_failing_run_raises_and_results_keep_their_order():
    pids = run_many([Run("a", _sleeps), Run("b", _sleeps), Run("c", _sleeps)], 2, Board(False))
    assert len(pids) == 3 and os.getpid() not in pids  # ran in worker processes
    with pytest.raises(ValueError, match="run two failed"):
        run_many([Run("a", _sleeps), Run("b", _fails)], 2)
