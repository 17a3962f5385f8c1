"""Pollux's co-adaptation, live: a real DDP job measures its gradient noise (silod.job.distributed,
from the ranks' gradients before and after DDP's all-reduce), its agent and the scheduler carry
the statistics to the estimator, and the job's fitted model leaves the profile's defaults for
the measured values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from estimator.job_model import JobModel
from silod.v1 import common_pb2, estimator_pb2_grpc, scheduler_pb2
from tests.cache_server.harness import register
from tests.e2e.harness import wait_until
from tests.support.procs import start_service

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp_digits.py"


def test_measured_gradient_noise_reaches_the_estimators_model(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import grpc

    with start_service("estimator", "--log-level", "warning", workdir=tmp_path / "estimator") as estimator:
        store = tmp_path / "digits"
        cluster = make_cluster("sqlite", nodes=2, gpus_per_node=2, policy="fifo",
                               scheduler_args=("--estimator-address", estimator.address), read_paths=(store,))
        subprocess.run([sys.executable, str(EXAMPLE), "prepare", str(store)], check=True, capture_output=True,
                       timeout=120)
        register(cluster.metadata.address, "noise-digits", f"file://{store}")
        spec = common_pb2.JobSpec(
            name="noise", application="cifar10", min_gpus=4, max_gpus=4, batch_size=64, epochs=3,
            dataset="noise-digits", command=[sys.executable, str(EXAMPLE)],
            env={"SILOD_EXAMPLE_STEP_SLEEP_S": "0.02"},
        )
        job = cluster.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30).id
        with grpc.insecure_channel(estimator.address) as channel:
            stub = estimator_pb2_grpc.EstimatorServiceStub(channel)

            def measured():  # type: ignore[no-untyped-def]
                try:
                    model = stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10)
                except grpc.RpcError as exc:  # NOT_FOUND until the scheduler's first Observe
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
                    return None
                return model if model.params.get("grad.reports_count", 0) >= 2 else None

            after = wait_until(measured, 120, "gradient statistics in the job's fitted model")
        done = cluster.wait_terminal([job], timeout=180)[job]
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.message
    sqr, var = after.params["grad.sqr_norm2"], after.params["grad.var_norm2"]
    assert sqr > 0 and var > 0
    profile = JobModel.from_profile("cifar10").grad  # what the model held before any measurement
    assert (sqr, var) != (profile.sqr, profile.var)
    # The noise scale a digits MLP shows at batch 64 is of the order of its batch sizes, not
    # the profile's CIFAR-10 ResNet value: B_noise = B0 * var / sqr.
    assert 1 < 64 * var / sqr < 100_000
