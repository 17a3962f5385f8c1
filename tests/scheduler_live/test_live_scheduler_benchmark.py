"""benchmarks/live_scheduler.py at a toy size: the in-process round figures docs/sizing.md quotes,
and a --churn too large for the cluster refused with what to use instead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import live_scheduler  # noqa: E402


def test_a_small_cluster_prints_every_figure(capfd: pytest.CaptureFixture[str]) -> None:
    assert live_scheduler.main(["--jobs", "60", "--nodes", "4", "--threads", "4", "--policy", "fifo", "--churn", "2"]) == 0
    printed = capfd.readouterr().out
    assert "submissions: 60 jobs over gRPC" in printed
    assert "round: 60 pending jobs on 4 nodes x 8 GPUs, fifo" in printed
    assert "steady round (2 placed jobs end and 2 arrive before each" in printed


def test_a_churn_the_first_round_cannot_feed_is_refused_naming_the_flag() -> None:
    with pytest.raises(SystemExit) as refused:
        live_scheduler.main(["--jobs", "60", "--nodes", "2", "--threads", "4", "--policy", "fifo", "--churn", "50"])
    assert "--churn 50" in str(refused.value.code) and "or less, or more --nodes" in str(refused.value.code)


def test_bad_flags_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, named in ((["--churn", "-1"], "--churn"), (["--nodes", "0"], "--nodes"), (["--jobs", "-5"], "--jobs")):
        with pytest.raises(SystemExit) as refused:
            live_scheduler.main(flags)
        assert refused.value.code == 2 and named in capsys.readouterr().err
