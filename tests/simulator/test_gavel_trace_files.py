"""Gavel's traces as Gavel writes them: `--workload FILE.trace` in both of its layouts, and
`silod simulate convert` to silod's CSV of the same jobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from silod.cli.main import main
from simulator import SimulatorInputError
from simulator.gavel_trace import TSV_LAYOUTS, load_gavel_trace
from simulator.loading import load_workload

MSR_HEAD = Path(__file__).parent / "data" / "gavel-msr-seed0-0e4a51-head.trace"


def _ten_field_rows(seven_field_text: str) -> str:
    """The same jobs in the layout Gavel's trace generator writes (10 fields a row)."""
    out = []
    for line in seven_field_text.splitlines():
        job_type, command, steps_arg, needs_data, steps, arrival, scale = line.split("\t")
        out.append("\t".join([job_type, command, "/tmp/workdir", steps_arg, needs_data, steps, scale, "1.0", "-1",
                              arrival]))
    return "\n".join(out) + "\n"


def _same_jobs(a, b) -> bool:  # type: ignore[no-untyped-def]
    return [(j.job_type, j.arrival_s, j.num_replicas, j.target_samples, j.application) for j in a.jobs] == \
        [(j.job_type, j.arrival_s, j.num_replicas, j.target_samples, j.application) for j in b.jobs]


def test_a_msr_trace_as_gavel_wrote_it_gives_the_packaged_traces_jobs() -> None:
    from_file = load_workload(MSR_HEAD)
    assert len(from_file) == 10 and TSV_LAYOUTS[7][0] == "job_type"
    packaged = load_gavel_trace("gavel/msr-seed0-0e4a51")
    # The file's rows are the packaged trace's first ten, and give the same jobs.
    first_ten = sorted(packaged.jobs, key=lambda j: j.name)[:10]
    assert [(j.job_type, j.arrival_s, j.num_replicas, j.target_samples) for j in from_file.jobs] == \
        [(j.job_type, j.arrival_s, j.num_replicas, j.target_samples) for j in sorted(first_ten, key=lambda j: j.arrival_s)]


def test_the_generators_ten_field_layout_is_read_as_well(tmp_path: Path) -> None:
    generated = tmp_path / "generated.trace"
    generated.write_text(_ten_field_rows(MSR_HEAD.read_text()))
    assert _same_jobs(load_workload(generated), load_workload(MSR_HEAD))


def test_convert_writes_silods_csv_of_the_same_jobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "converted.csv"
    assert main(["simulate", "convert", str(MSR_HEAD), "--out", str(out)]) == 0
    assert "wrote 10 jobs" in capsys.readouterr().err
    assert out.read_text().splitlines()[0] == "job_type,total_steps,arrival_s,scale_factor"
    assert _same_jobs(load_workload(out), load_workload(MSR_HEAD))


def test_a_trace_file_runs_in_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("nodes: 2\ngpus_per_node: 4\n")
    out = tmp_path / "out"
    assert main(["simulate", "run", "--workload", str(MSR_HEAD), "--policy", "fifo", "--cluster", str(cluster),
                 "--out", str(out), "--no-plots"]) == 0
    assert "fifo on" in capsys.readouterr().out and (out / "summary.json").exists()


@pytest.mark.parametrize(("row", "message"), [
    ("CycleGAN\tcmd\t--n_steps\t1\t71711\t17.0", r"row 2: 6 tab-separated fields; a Gavel trace row has 7 \(job_type"),
    ("CycleGAN\tcmd\t--n_steps\t1\tmany\t17.0\t1", r"row 2 field 5 \(total_steps\): expected a whole number >= 1, got 'many'"),
    ("CycleGAN\tcmd\t--n_steps\t1\t71711\t-3\t1", r"row 2 field 6 \(arrival_s\): expected seconds"),
    ("CycleGAN\tcmd\t--n_steps\t1\t71711\t17.0\t0", r"row 2 field 7 \(scale_factor\): expected a whole number of GPUs"),
    ("Nope\tcmd\t--n_steps\t1\t71711\t17.0\t1", r"row 2 field 1 \(job_type\): unknown Gavel job type 'Nope'"),
    ("CycleGAN\tcmd\twd\t--n_steps\t1\t71711\t1\t1.0\t-1\tsoon", r"row 2 field 10 \(arrival_s\)"),
])
def test_a_bad_row_is_named_by_row_and_field(tmp_path: Path, row: str, message: str) -> None:
    trace = tmp_path / "bad.trace"
    trace.write_text(MSR_HEAD.read_text().splitlines()[0] + "\n" + row + "\n")
    with pytest.raises(SimulatorInputError, match=message):
        load_workload(trace)
    assert main(["simulate", "convert", str(trace), "--out", str(tmp_path / "x.csv")]) == 2


def test_convert_refuses_what_is_not_a_gavel_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv = tmp_path / "pollux.csv"
    csv.write_text("name,time,application,num_replicas,batch_size\nj,0,ncf,1,32768\n")
    assert main(["simulate", "convert", str(csv), "--out", str(tmp_path / "x.csv")]) == 2
    assert "not a Gavel trace" in capsys.readouterr().err
    assert main(["simulate", "convert", str(tmp_path / "absent.trace"), "--out", str(tmp_path / "x.csv")]) == 2
