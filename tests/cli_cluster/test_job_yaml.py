"""Unit tests of the job YAML parsing behind `silod submit`."""

from __future__ import annotations

from pathlib import Path

import pytest

from silod.cli.jobs import JobFileError, parse_job_yaml, request_id_for
from silod.cli.main import main as silod
from silod.v1 import common_pb2
from tests.support.procs import free_port


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


def _nothing_listens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No scheduler where the client looks: this machine's default port (127.0.0.1:7073) may
    be another test's compose cluster meanwhile, so a client config naming a free port comes
    before it."""
    monkeypatch.delenv("SILOD_SCHEDULER_ADDR", raising=False)
    config = tmp_path / "client.yaml"
    config.write_text(f"scheduler: 127.0.0.1:{free_port()}\n")
    monkeypatch.setenv("SILOD_CLIENT_CONFIG", str(config))


def test_no_cluster_is_one_line_pointing_at_silod_up(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _nothing_listens(tmp_path, monkeypatch)
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


def test_image_cores_and_memory_per_rank() -> None:
    spec = parse_job_yaml("image: registry.example:5000/team/train:1.4\ncpus_per_rank: 2.5\nmemory_per_rank: 4Gi\n")
    assert (spec.image, spec.cpus_per_rank, spec.memory_bytes_per_rank) == ("registry.example:5000/team/train:1.4", 2.5, 4 * 2**30)
    assert parse_job_yaml("cpus_per_rank: 4\n").cpus_per_rank == 4.0


@pytest.mark.parametrize(("value", "expected"), [
    ("512Mi", 512 * 2**20), ("4Gi", 4 * 2**30), ("2G", 2 * 10**9), ("1.5Gi", 3 * 2**29), ("100M", 10**8),
    ("64Ki", 64 * 1024), ("8 GiB", 8 * 2**30), ("2GB", 2 * 10**9), ("0.1Gi", 107374183), ("1Ti", 2**40),
    (1073741824, 2**30), ("1073741824", 2**30), (0, 0),
])
def test_memory_per_rank_takes_bytes_or_a_unit(value: object, expected: int) -> None:
    assert parse_job_yaml(f"memory_per_rank: {value}\n").memory_bytes_per_rank == expected


@pytest.mark.parametrize(("text", "needle"), [
    ("memory_per_rank: lots\n", "key 'memory_per_rank' must be bytes: an integer or a number with a unit such as 512Mi"),
    ("memory_per_rank: 4Gb\n", "key 'memory_per_rank' must be bytes"),
    ("memory_per_rank: 1.5\n", "key 'memory_per_rank' must be bytes"),
    ("memory_per_rank: -1\n", "key 'memory_per_rank' must be bytes"),
    ("memory_per_rank: true\n", "key 'memory_per_rank' must be bytes"),
    ("memory_per_rank: 99999999Ei\n", "key 'memory_per_rank' is out of range"),
    ("cpus_per_rank: many\n", "key 'cpus_per_rank' must be a number, got 'many'"),
    ("image: [a, b]\n", "key 'image' must be a string"),
    ("memory_bytes_per_rank: 4\n", "unknown key 'memory_bytes_per_rank'"),
])
def test_bad_request_keys_are_named(text: str, needle: str) -> None:
    with pytest.raises(JobFileError) as info:
        parse_job_yaml(text, "job.yaml")
    assert needle in str(info.value)


def test_jobs_show_prints_the_image_and_requests_when_set() -> None:
    from silod.cli.jobs import job_lines

    job = common_pb2.Job(id="job-0123456789ab", state=common_pb2.JOB_STATE_RUNNING, spec=common_pb2.JobSpec(
        name="train", tenant="t1", application="cifar10", min_gpus=2, max_gpus=4, batch_size=64,
        image="team/train:1.4", cpus_per_rank=2.5, memory_bytes_per_rank=4 * 2**30))
    lines = job_lines(job)
    assert "image:           team/train:1.4" in lines
    assert "cpus per rank:   2.5" in lines
    assert "memory per rank: 4.0 GiB (4294967296 B)" in lines
    assert "state:           RUNNING" in lines and "gpus:            2..4 (0 allocated)" in lines
    plain = "\n".join(job_lines(common_pb2.Job(id="job-0123456789ab", spec=common_pb2.JobSpec(name="p"))))
    assert "image" not in plain and "per rank" not in plain


def test_jobs_show_is_a_command(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _nothing_listens(tmp_path, monkeypatch)
    assert silod(["jobs", "show", "job-0123456789ab", "--state-dir", str(tmp_path)]) == 1
    assert "silod up" in capsys.readouterr().err  # it went looking for the scheduler
    with pytest.raises(SystemExit):
        silod(["jobs", "show", "not a job id"])


def test_nodes_table_shows_runtime_cores_and_memory() -> None:
    from silod.cli.nodes import node_rows, node_table

    nodes = [common_pb2.Node(spec=common_pb2.NodeSpec(name="new", gpus=4, runtime="contained", cpus=31.5,
                                                      memory_bytes=256 * 2**30), alive=True),
             common_pb2.Node(spec=common_pb2.NodeSpec(name="old", gpus=4), alive=True)]
    rows = node_rows(nodes, None)
    assert [(r["runtime"], r["cpus"], r["memory_bytes"]) for r in rows] == [("contained", 31.5, 256 * 2**30), ("", 0.0, 0)]
    header, new, old = node_table(rows)
    assert header.split() == ["NAME", "POOL", "TYPE", "RUNTIME", "GPUS", "CPUS", "MEMORY", "CACHE", "ALIVE", "HEARTBEAT", "PLAN"]
    assert new.split()[3:9] == ["contained", "0/4", "31.5", "256.0", "GiB", "0"]
    assert old.split()[3:7] == ["-", "0/4", "-", "-"]  # an older agent reports neither
