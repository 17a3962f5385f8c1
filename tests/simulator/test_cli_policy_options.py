"""`silod simulate --set POLICY.OPTION=VALUE`: options reach the policy and are recorded; bad ones are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKLOAD_HEAD = "name,time,application,num_replicas,batch_size\n" + "".join(
    f"cifar10-{i},{i * 30},cifar10,{1 + i % 2},{128 * (1 + i % 2)}\n" for i in range(6)
)


def _simulate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "silod.cli", "simulate", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture()
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    path.write_text(WORKLOAD_HEAD)
    return path


def test_option_reaches_the_policy_and_is_recorded(workload: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _simulate("--workload", str(workload), "--policy", "pollux", "--set", "pollux.p=0.5",
                       "--set", "penalty_model=age", "--out", str(out), "--quiet", "--no-plots")
    assert result.returncode == 0, result.stderr
    options = json.loads((out / "summary.json").read_text())["policy_options"]
    assert options["p"] == 0.5 and options["penalty_model"] == "age"


def test_compare_applies_options_per_policy(workload: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    result = _simulate("compare", "--workload", str(workload), "--policy", "tiresias", "--policy", "fifo",
                       "--set", "tiresias.thresholds_gpu_s=(100,)", "--out", str(out), "--quiet", "--no-plots")
    assert result.returncode == 0, result.stderr
    tiresias = json.loads((out / "tiresias" / "summary.json").read_text())["policy_options"]
    assert tiresias["thresholds_gpu_s"] == [100]
    assert json.loads((out / "fifo" / "summary.json").read_text())["policy_options"] == {"backfill": True, "codesign": False}


@pytest.mark.parametrize("setting, message", [
    ("pollux.q=1", "pollux has no option 'q'"),
    ("p", "expected POLICY.OPTION=VALUE"),
    ("gavel.elastic=1", "policy 'gavel' is not being run"),
    ("pollux.p=oops", "--set pollux.p='oops'"),
])
def test_bad_option_is_named_without_traceback(workload: Path, tmp_path: Path, setting: str, message: str) -> None:
    result = _simulate("--workload", str(workload), "--policy", "pollux", "--set", setting,
                       "--out", str(tmp_path / "x"), "--quiet", "--no-plots")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unprefixed_option_is_ambiguous_with_several_policies(workload: Path, tmp_path: Path) -> None:
    result = _simulate("compare", "--workload", str(workload), "--policy", "fifo", "--policy", "pollux",
                       "--set", "p=1", "--out", str(tmp_path / "x"), "--quiet", "--no-plots")
    assert result.returncode == 2 and "name the policy" in result.stderr
