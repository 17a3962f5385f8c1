"""Unit tests of the job YAML parsing behind `silod submit`."""

from __future__ import annotations

from pathlib import Path

import pytest

from silod.cli.jobs import JobFileError, parse_job_yaml, request_id_for
from silod.cli.main import main as silod
from silod.v1 import common_pb2


def test_all_fields_map_to_the_job_spec() -> None:
    spec = parse_job_yaml(
        "name: a\napplication: cifar10\nmin_gpus: 1\nmax_gpus: 4\nbatch_size: 32\nepochs: 3\n"
        "dataset: imgs\ncommand: python train.py --lr 0.1\nenv: {A: 1, B: true}\n"
        "emulated_step_compute_s: 0.01\npriority: 2\ntenant: t1\nkind: inference\n"
    )
    assert (spec.name, spec.application, spec.min_gpus, spec.max_gpus, spec.batch_size) == ("a", "cifar10", 1, 4, 32)
    assert spec.WhichOneof("budget") == "epochs" and spec.epochs == 3
    assert list(spec.command) == ["python", "train.py", "--lr", "0.1"]
    assert dict(spec.env) == {"A": "1", "B": "true"}
    assert spec.emulated_step_compute_s == 0.01 and spec.priority == 2 and spec.tenant == "t1"
    assert spec.kind == common_pb2.JOB_KIND_INFERENCE
    assert parse_job_yaml("sample_budget: 10\ncommand: [x, y]").sample_budget == 10
    assert list(parse_job_yaml("gpu_types: [a100, h100]").gpu_types) == ["a100", "h100"]
    assert list(parse_job_yaml("gpu_types: v100").gpu_types) == ["v100"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: a\nbogus_key: 1\n", "unknown key 'bogus_key'"),
        ("min_gpus: two\n", "'min_gpus' must be an integer"),
        ("min_gpus: true\n", "'min_gpus' must be an integer"),
        ("epochs: 1\nsample_budget: 5\n", "either 'epochs' or 'sample_budget'"),
        ("kind: batch\n", "'kind' must be"),
        ("env: [a, b]\n", "'env' must be a mapping"),
        ("name: [1]\n", "'name' must be a string"),
        ("- a\n- b\n", "expected a mapping"),
        ("name: [unclosed\n", "not valid YAML"),
        ("emulated_step_compute_s: fast\n", "must be a number"),
        ("gpu_types: {a100: 1}\n", "'gpu_types' must be a list"),
    ],
)
def test_invalid_files_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(JobFileError, match="job.yaml") as info:
        parse_job_yaml(text, "job.yaml")
    assert needle in str(info.value)


def test_submit_exits_2_on_an_unknown_key_without_contacting_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: a\nnum_gpus: 2\n")
    assert silod(["submit", str(f), "--state-dir", str(tmp_path)]) == 2
    assert "unknown key 'num_gpus'" in capsys.readouterr().err


def test_no_cluster_is_one_line_pointing_at_silod_up(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SILOD_SCHEDULER_ADDR", raising=False)
    assert silod(["jobs", "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "silod up" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_request_id_depends_only_on_content() -> None:
    assert request_id_for(b"a: 1") == request_id_for(b"a: 1") != request_id_for(b"a: 2")
    assert len(request_id_for(b"x")) <= 128


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: a\nnum_gpus: 2\nbatch_size: big\ndataset: ../data\nepochs: 1\n")
    assert silod(["submit", str(f), "--state-dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3, lines
    assert "unknown key 'num_gpus'" in lines[0]
    assert "key 'batch_size' must be an integer, got 'big'" in lines[1]
    assert "key 'dataset': a dataset name may not contain '/'" in lines[2]
    assert all(line.startswith(f"silod: {f}: ") for line in lines)
