"""Measured step times reported by agents reach the estimator (Observe) and come back as the
job's fitted model: metadata, estimator and scheduler served over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from estimator.gpu_types import typed_models
from estimator.per_type import fitted_type_models
from estimator.service import Settings as EstimatorSettings
from estimator.service import definition as estimator_definition
from silod.v1 import allocation_pb2, common_pb2, estimator_pb2, estimator_pb2_grpc
from tests.scheduler_live.harness import wait_for
from tests.support.inprocess import InProcessServer

RUNNING = allocation_pb2.TASK_PHASE_RUNNING
BATCH = 128


def _compute_rate(stub, job_id: str, gpus: int) -> float:
    answer = stub.Predict(estimator_pb2.PredictRequest(queries=[estimator_pb2.PredictQuery(
        job_id=job_id, application="cifar10",
        candidates=[estimator_pb2.CandidateAllocation(gpus=gpus, nodes=1, batch_size=BATCH)])]))
    return answer.results[0].predictions[0].compute_samples_per_s


def test_reported_step_times_refit_the_jobs_model_in_the_estimator(make_cluster) -> None:
    cluster = make_cluster()
    # The estimator persists fitted models in the metadata service the scheduler uses; the
    # scheduler is then restarted knowing the estimator's address, as `silod up` starts it.
    settings = EstimatorSettings(metadata_address=cluster.metadata.address)
    with InProcessServer(estimator_definition(settings), settings, thread_name="estimator") as estimator:
        cluster._settings = cluster._settings.model_copy(update={"estimator_address": estimator.address})
        cluster.restart_scheduler()
        try:
            stub = estimator_pb2_grpc.EstimatorServiceStub(estimator.channel)
            cluster.add_node("n1", gpus=2)
            job = cluster.submit("measured", min_gpus=2, max_gpus=2, batch_size=BATCH)
            plan = cluster.round()
            entry = next(j for j in plan.jobs if j.job_id == job.id)
            assert len([i for p in entry.placements for i in p.gpu_indices]) == 2

            with pytest.raises(grpc.RpcError) as before:
                stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job.id))
            assert before.value.code() == grpc.StatusCode.NOT_FOUND
            profile_rate = _compute_rate(stub, job.id, 2)

            # The job runs three times slower than its profile predicts.
            step_time = 3 * BATCH / profile_rate
            for steps in (10, 20, 30):
                progress = common_pb2.JobProgress(samples_done=steps * BATCH, steps_done=steps,
                                                  throughput_samples_per_s=BATCH / step_time)
                cluster.report("n1", plan.version,
                               allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=entry.generation, phase=RUNNING,
                                                         gpu_indices=[0], progress=progress, step_time_s=step_time,
                                                         batch_size=BATCH),
                               allocation_pb2.TaskReport(job_id=job.id, rank=1, generation=entry.generation, phase=RUNNING,
                                                         gpu_indices=[1]))
                # Observe runs in the background; wait for this one before sending the next. The
                # first fits the application's profile in the estimator: seconds on a busy machine.
                wait_for(lambda s=steps: _observations(stub, job.id) >= s // 10, timeout=30,
                         what=f"observation {steps // 10}")

            model = stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job.id))
            assert model.observations == 3
            assert model.application == "cifar10" and model.params
            fitted_rate = _compute_rate(stub, job.id, 2)
            assert fitted_rate == pytest.approx(BATCH / step_time, rel=0.25), (profile_rate, fitted_rate)

            # The same report again is not a new measurement.
            cluster.report("n1", plan.version,
                           allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=entry.generation, phase=RUNNING,
                                                     gpu_indices=[0], progress=progress, step_time_s=step_time,
                                                     batch_size=BATCH))
            assert stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job.id)).observations == 3
        finally:
            cluster.close()  # before the estimator it talks to


def test_reports_go_on_when_the_estimator_is_down(make_cluster) -> None:
    # An address nobody serves: Observe fails in the background, the report path does not.
    cluster = make_cluster(estimator_address="127.0.0.1:9")
    cluster.add_node("n1", gpus=1)
    job = cluster.submit("unobserved")
    plan = cluster.round()
    entry = next(j for j in plan.jobs if j.job_id == job.id)
    progress = common_pb2.JobProgress(samples_done=BATCH, steps_done=1, throughput_samples_per_s=100.0)
    cluster.report("n1", plan.version,
                   allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=entry.generation, phase=RUNNING,
                                             gpu_indices=[0], progress=progress, step_time_s=1.28, batch_size=BATCH))
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING


def _observations(stub, job_id: str) -> int:
    try:
        return stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job_id)).observations
    except grpc.RpcError:
        return 0


def _typed_rate(stub, job_id: str, gpus: int, gpu_type: str) -> float:
    answer = stub.Predict(estimator_pb2.PredictRequest(queries=[estimator_pb2.PredictQuery(
        job_id=job_id, application="cifar10", candidates=[estimator_pb2.CandidateAllocation(
            gpus=gpus, nodes=1, batch_size=BATCH, gpu_type=gpu_type)])]))
    return answer.results[0].predictions[0].compute_samples_per_s


def test_steps_on_typed_nodes_refit_the_jobs_model_on_that_type(make_cluster) -> None:
    cluster = make_cluster()
    settings = EstimatorSettings(metadata_address=cluster.metadata.address)
    with InProcessServer(estimator_definition(settings), settings, thread_name="estimator") as estimator:
        cluster._settings = cluster._settings.model_copy(update={"estimator_address": estimator.address})
        cluster.restart_scheduler()
        try:
            stub = estimator_pb2_grpc.EstimatorServiceStub(estimator.channel)
            # Two types the job may use; only the a100 (unknown to the measured table) has room.
            cluster.add_node("a100-0", gpus=2, gpu_type="a100")
            cluster.add_node("k80-0", gpus=1, gpu_type="k80")
            job = cluster.submit("typed", min_gpus=2, max_gpus=2, batch_size=BATCH)
            plan = cluster.round()
            entry = next(j for j in plan.jobs if j.job_id == job.id)
            assert entry.gpu_type == "a100" and {p.node for p in entry.placements} == {"a100-0"}

            default = _typed_rate(stub, job.id, 2, "a100")
            untyped = _typed_rate(stub, job.id, 2, "")
            assert default == untyped  # a type the table lacks starts as the reference
            snapshot, _ = cluster.scheduler.submit(cluster.core.snapshot())
            info = next(j for j in snapshot.jobs if j.job_id == job.id)
            assert info.model_on("a100").perf == info.model.perf

            # This job runs 2x slower on these a100s than the default says (whole steps, no sync time).
            step_time = 2 * BATCH / default
            for steps in (10, 20, 30):
                progress = common_pb2.JobProgress(samples_done=steps * BATCH, steps_done=steps,
                                                  throughput_samples_per_s=BATCH / step_time)
                cluster.report("a100-0", plan.version,
                               allocation_pb2.TaskReport(job_id=job.id, rank=0, generation=entry.generation, phase=RUNNING,
                                                         gpu_indices=[0], progress=progress, step_time_s=step_time,
                                                         batch_size=BATCH),
                               allocation_pb2.TaskReport(job_id=job.id, rank=1, generation=entry.generation, phase=RUNNING,
                                                         gpu_indices=[1]))
                wait_for(lambda s=steps: _observations(stub, job.id) >= s // 10, timeout=30,
                         what=f"observation {steps // 10}")

            model = stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job.id))
            assert "type[a100].perf.beta_c_s_per_sample" in model.params
            assert model.params["type[a100].compute_speed_ratio"] < 0.75
            # The a100 model moved to what was measured there; the reference (untyped) one did not.
            assert _typed_rate(stub, job.id, 2, "a100") == pytest.approx(BATCH / step_time, rel=0.01)
            assert _typed_rate(stub, job.id, 2, "") == untyped
            # The scheduler prices the job on the a100 with the estimator's fit, on the k80 as before.
            snapshot, _ = cluster.scheduler.submit(cluster.core.snapshot())
            info = next(j for j in snapshot.jobs if j.job_id == job.id)
            fitted = fitted_type_models(info.model, dict(model.params))["a100"]
            assert info.model_on("a100").perf == fitted.perf
            assert info.model_on("k80").perf == typed_models(info.model, ["k80"])["k80"].perf
        finally:
            cluster.close()
