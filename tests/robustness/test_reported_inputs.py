"""The inputs issue 17 reported, on the real cluster: each answers INVALID_ARGUMENT naming the
field (not INTERNAL), and a job file with several mistakes gets all of them back at once."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from silod.cli.main import main as silod
from silod.rpc.errors import FieldViolation, field_violations
from silod.v1 import common_pb2, estimator_pb2_grpc, worker_agent_pb2, worker_agent_pb2_grpc
from tests.robustness.conftest import Cluster


def _refusal(call) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_get_job_model_with_a_nul_job_id_names_the_field(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.address("estimator")) as channel:
        stub = estimator_pb2_grpc.EstimatorServiceStub(channel)
        error = _refusal(lambda: stub.GetJobModel(common_pb2.GetJobModelRequest(job_id="\x00"), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("job_id: a job id may not contain '\\x00'")
    assert [v.field for v in field_violations(error)] == ["job_id"]


def test_tail_logs_with_a_job_id_of_thousands_of_characters_names_the_field(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.address("worker-agent")) as channel:
        stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
        for job_id in ("j" * 4000, "../" * 20 + "etc", ".."):
            error = _refusal(lambda: list(stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id=job_id), timeout=10)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, job_id
            assert error.details().startswith("job_id: a job id "), error.details()
        # The log of the real job is still served.
        chunks = list(stub.TailLogs(worker_agent_pb2.TailLogsRequest(job_id=cluster.job_id, tail_bytes=20), timeout=10))
        assert b"".join(c.data for c in chunks).endswith(b"loss 0.005\n")


def test_a_job_file_with_three_mistakes_gets_three_lines(cluster: Cluster, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: three mistakes\napplication: cifar10\nmin_gpus: 0\nmax_gpus: 2\nbatch_size: 0\n")  # no budget
    code = silod(["submit", str(job), "--scheduler", cluster.address("scheduler")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert lines == [
        "silod: INVALID_ARGUMENT: spec.min_gpus: must be in 1..4096, got 0",
        "silod: INVALID_ARGUMENT: spec.batch_size: must be in 1..16777216, got 0",
        "silod: INVALID_ARGUMENT: spec.budget: a training job needs exactly one of epochs or sample_budget",
    ]


def test_every_problem_is_in_the_status_details(cluster: Cluster) -> None:
    from silod.v1 import scheduler_pb2, scheduler_pb2_grpc

    spec = common_pb2.JobSpec(name="bad\x07name", application="no-such-app", dataset="../up", min_gpus=9000,
                              max_gpus=1, batch_size=0, epochs=0, tenant="a b")
    with grpc.insecure_channel(cluster.address("scheduler")) as channel:
        stub = scheduler_pb2_grpc.JobServiceStub(channel)
        error = _refusal(lambda: stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(error)
    # The runtime refuses malformed identifiers before the servicer runs: those come first, alone.
    assert [v.field for v in violations] == ["spec.tenant", "spec.dataset"]
    spec.ClearField("tenant")
    spec.ClearField("dataset")
    with grpc.insecure_channel(cluster.address("scheduler")) as channel:
        stub = scheduler_pb2_grpc.JobServiceStub(channel)
        error = _refusal(lambda: stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=10))
    fields = [v.field for v in field_violations(error)]
    assert fields == ["spec.name", "spec.min_gpus", "spec.max_gpus", "spec.batch_size", "spec.epochs",
                      "spec.application"]
    assert all(isinstance(v, FieldViolation) and v.description for v in field_violations(error))
    assert all(f"{field}: " in error.details() for field in fields)  # the message carries them all too


def test_cli_refuses_malformed_ids_before_calling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No cluster is named: the argument alone is refused, exit 2 (argparse's usage error).
    for argv in (["logs", "x" * 3000], ["cancel", "../etc"], ["watch", ""], ["dataset", "show", "a/b"]):
        with pytest.raises(SystemExit) as exited:
            silod([*argv, "--state-dir", str(tmp_path)])
        assert exited.value.code == 2, argv
        err = capsys.readouterr().err
        assert "argument" in err and ("job id" in err or "dataset name" in err), err
