"""``silod simulate``: outputs, their consistency, the compare and generate actions, and bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scheduler.registry import policy_names
from silod.cli.main import main

HEADER = "name,time,application,num_replicas,batch_size\n"
SMALL = HEADER + "ncf-0,0,ncf,1,32768\ncifar10-1,20,cifar10,4,1024\nncf-2,45,ncf,1,32768\ncifar10-3,70,cifar10,2,512\nbert-4,90,bert,2,48\n"


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, Path]:
    workload = tmp_path / "small.csv"
    workload.write_text(SMALL)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: 2\ngpus_per_node: 4\n")
    return workload, cluster


def _jobs_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_run_writes_consistent_outputs(small, tmp_path: Path, capsys):
    workload, cluster = small
    out = tmp_path / "out"
    assert main(["simulate", "--workload", str(workload), "--policy", "fifo", "--cluster", str(cluster), "--out", str(out)]) == 0
    assert "fifo on" in capsys.readouterr().out
    for name in ("summary.json", "jobs.csv", "jct_cdf.png", "utilization.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    rows = _jobs_csv(out / "jobs.csv")
    assert len(rows) == summary["jobs"] == 5
    jct = np.array([float(r["jct_s"]) for r in rows])
    assert summary["avg_jct_s"] == pytest.approx(jct.mean(), abs=1e-3)
    assert summary["p50_jct_s"] == pytest.approx(np.percentile(jct, 50), abs=1e-3)
    assert summary["p99_jct_s"] == pytest.approx(np.percentile(jct, 99), abs=1e-3)
    makespan = max(float(r["finish_s"]) for r in rows) - min(float(r["arrival_s"]) for r in rows)
    assert summary["makespan_s"] == pytest.approx(makespan, abs=1e-3)
    gpu_s = sum(float(r["attained_gpu_s"]) for r in rows)
    assert summary["gpu_utilization"] == pytest.approx(gpu_s / (8 * makespan), abs=1e-5)
    assert summary["restarts"] == sum(int(r["restarts"]) for r in rows)
    rho = [float(r["rho"]) for r in rows]
    assert summary["rho_max"] == pytest.approx(max(rho), abs=1e-5)
    assert summary["rho_mean"] == pytest.approx(np.mean(rho), abs=1e-5)
    for r in rows:
        assert float(r["jct_s"]) == pytest.approx(float(r["finish_s"]) - float(r["arrival_s"]), abs=1e-5)
        assert float(r["rho"]) == pytest.approx(float(r["jct_s"]) / float(r["isolated_jct_s"]), abs=1e-5)
    assert summary["policy"] == "fifo" and summary["cluster"]["gpus"] == 8 and summary["wall_time_s"] > 0


def test_run_action_is_the_same_as_the_default(small, tmp_path: Path):
    workload, cluster = small
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--workload", str(workload), "--policy", "fifo", "--cluster", str(cluster), "--no-plots", "--quiet"]
    assert main(["simulate", *common, "--out", str(a)]) == 0
    assert main(["simulate", "run", *common, "--out", str(b)]) == 0
    assert (a / "jobs.csv").read_text() == (b / "jobs.csv").read_text()
    assert not (a / "jct_cdf.png").exists()


def test_compare_writes_one_table_and_one_plot(small, tmp_path: Path, capsys):
    workload, cluster = small
    names = ["fifo"] + [n for n in policy_names() if n != "fifo"][:2]
    out = tmp_path / "cmp"
    argv = ["simulate", "compare", "--workload", str(workload), "--cluster", str(cluster), "--out", str(out)]
    for name in names:
        argv += ["--policy", name]
    assert main(argv) == 0
    table = (out / "compare.md").read_text()
    assert all(f"| {name} |" in table for name in names)
    data = json.loads((out / "compare.json").read_text())
    assert list(data["policies"]) == names
    assert (out / "compare.png").stat().st_size > 0
    for name in names:
        summary = json.loads((out / name / "summary.json").read_text())
        assert data["policies"][name]["avg_jct_s"] == summary["avg_jct_s"]
    assert "avg JCT" in capsys.readouterr().out


def test_generate_writes_a_deterministic_workload(tmp_path: Path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    assert main(["simulate", "generate", "--philly", "--jobs", "30", "--seed", "5", "--out", str(a)]) == 0
    assert main(["simulate", "generate", "--philly", "--jobs", "30", "--seed", "5", "--out", str(b)]) == 0
    assert a.read_text() == b.read_text()
    assert a.read_text().startswith(HEADER)
    assert len(a.read_text().splitlines()) == 31


@pytest.mark.parametrize("argv, message", [
    (["--policy", "nope"], "unknown policy 'nope'; known: "),  # the list grows as policies are added
    (["--workload", "MISSING"], "workload MISSING: no such file"),
    (["--workload", "BADROW"], "row 3, column 'time'"),
    (["--cluster", "BADYAML"], "cluster field 'interval_s'"),
    (["--cluster", "MISSING"], "cluster spec MISSING: no such file"),
])
def test_bad_input_exits_2_with_one_message(small, tmp_path: Path, capsys, argv, message):
    workload, cluster = small
    bad_row = tmp_path / "bad.csv"
    bad_row.write_text(HEADER + "a,1,ncf,1,256\nb,soon,ncf,1,256\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("nodes: 1\ninterval_s: -5\n")
    options = {"--workload": str(workload), "--policy": "fifo", "--cluster": str(cluster), "--out": str(tmp_path / "o")}
    options.update(dict(zip(argv[::2], argv[1::2])))
    replace = {"BADROW": str(bad_row), "BADYAML": str(bad_yaml), "MISSING": "MISSING"}
    flat = [x for k, v in options.items() for x in (k, replace.get(v, v))]
    assert main(["simulate", *flat, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_required_flags_exit_2(capsys):
    assert main(["simulate", "--policy", "fifo"]) == 2
    assert "--workload, --out required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse's own errors: also status 2
        main(["simulate", "compare", "--workload", "workload-6", "--out", "x"])
    assert exc.value.code == 2


def test_console_script_reports_without_traceback(tmp_path: Path):
    run = subprocess.run(
        [sys.executable, "-m", "silod.cli", "simulate", "compare", "--workload", "workload-6", "--policy", "fifo",
         "--policy", "bogus", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.startswith("silod simulate: error: unknown policy 'bogus'")
    assert "Traceback" not in run.stderr


def test_list_shows_workloads_and_policies(capsys):
    assert main(["simulate", "list"]) == 0
    out = capsys.readouterr().out
    assert "fifo" in out and "workloads-2.0/workload-8" in out
