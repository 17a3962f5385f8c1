"""``silod estimator`` as a real process next to a real ``silod metadata`` (SQLite): fitted models
survive a crash of the estimator; without a metadata service they do not."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from silod.v1 import common_pb2, estimator_pb2, estimator_pb2_grpc, metadata_pb2, metadata_pb2_grpc
from tests.support.procs import ServiceProcess, start_service


def estimator_stub(proc: ServiceProcess, channels: list[grpc.Channel]) -> estimator_pb2_grpc.EstimatorServiceStub:
    channel = grpc.insecure_channel(proc.address)
    channels.append(channel)
    return estimator_pb2_grpc.EstimatorServiceStub(channel)


def observe_request(job_id: str, step_time_s: float) -> estimator_pb2.ObserveRequest:
    reports = [
        estimator_pb2.StepObservation(gpus=g, nodes=1, batch_size=b, step_time_s=step_time_s * b / 512, sync_time_s=0.05 if g > 1 else 0.0, grad_sqr=0.3, grad_var=9.0)
        for g, b in ((1, 256), (2, 512), (4, 1024))
    ]
    return estimator_pb2.ObserveRequest(job_id=job_id, application="cifar10", observations=reports)


PREDICT = estimator_pb2.PredictRequest(
    queries=[
        estimator_pb2.PredictQuery(
            job_id="",  # set per test
            candidates=[
                estimator_pb2.CandidateAllocation(gpus=4, cache_bytes=10**8, remote_io_bytes_per_s=10**8),
                estimator_pb2.CandidateAllocation(gpus=8, nodes=2, cache_bytes=10**9, remote_io_bytes_per_s=10**9, batch_size=1024),
            ],
        )
    ]
)


def test_a_killed_estimator_resumes_from_the_models_it_persisted(tmp_path: Path) -> None:
    channels: list[grpc.Channel] = []
    try:
        with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'metadata.db'}", workdir=tmp_path) as metadata:
            channel = grpc.insecure_channel(metadata.address)
            channels.append(channel)
            spec = common_pb2.JobSpec(name="resnet", application="cifar10", min_gpus=1, max_gpus=8, batch_size=128, epochs=1)
            job = metadata_pb2_grpc.MetadataServiceStub(channel).CreateJob(metadata_pb2.CreateJobRequest(spec=spec), timeout=10).id
            predict = estimator_pb2.PredictRequest()
            predict.CopyFrom(PREDICT)
            predict.queries[0].job_id = job

            first = start_service("estimator", "--metadata-address", metadata.address, workdir=tmp_path)
            try:
                stub = estimator_stub(first, channels)
                model = stub.Observe(observe_request(job, 0.9), timeout=30).model
                predictions = stub.Predict(predict, timeout=30)
                assert first.kill() != 0  # SIGKILL: no shutdown code runs
            finally:
                first.close()

            with start_service("estimator", "--metadata-address", metadata.address, workdir=tmp_path) as second:
                stub = estimator_stub(second, channels)
                assert stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=30) == model
                assert stub.Predict(predict, timeout=30) == predictions
                resumed = stub.Observe(estimator_pb2.ObserveRequest(job_id=job, observations=observe_request(job, 1.1).observations), timeout=30)
                assert resumed.model.observations == 2 * model.observations
                assert second.terminate() == 0
                stored = metadata_pb2_grpc.MetadataServiceStub(channel).GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10)
                assert stored == resumed.model
    finally:
        for channel in channels:
            channel.close()


def test_without_a_metadata_service_models_live_in_memory_only(tmp_path: Path) -> None:
    channels: list[grpc.Channel] = []
    try:
        with start_service("estimator", workdir=tmp_path) as first:
            model = estimator_stub(first, channels).Observe(observe_request("job-local", 0.5), timeout=30).model
            assert model.observations == 3
            assert estimator_stub(first, channels).GetJobModel(common_pb2.GetJobModelRequest(job_id="job-local"), timeout=10) == model
        with start_service("estimator", workdir=tmp_path) as second:
            with pytest.raises(grpc.RpcError) as missing:
                estimator_stub(second, channels).GetJobModel(common_pb2.GetJobModelRequest(job_id="job-local"), timeout=10)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert missing.value.details().startswith("job_id:")
    finally:
        for channel in channels:
            channel.close()
