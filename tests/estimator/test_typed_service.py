"""EstimatorService per GPU type over real gRPC: candidates and observations name the type, the
service predicts and fits per (application, type), checked number for number against the
in-process models (estimator.per_type, estimator.gpu_types)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from estimator.goodput import step_time
from estimator.gpu_types import GPU_TYPE_PATTERN, MAX_SPEED, application_speed, speed_from_step_times, typed_models
from estimator.job_model import PERF_KEYS, JobModel
from estimator.model_store import MAX_GPU_TYPES_PER_JOB, MAX_PARAMS
from estimator.per_type import SPEED_KEY, TypedModels, fitted_type_models, type_key
from estimator.predict import predict
from services.metadata.validation.common import GPU_TYPE_PATTERN as METADATA_GPU_TYPE_PATTERN
from silod.v1 import common_pb2, estimator_pb2, estimator_pb2_grpc
from tests.estimator.test_service import assert_fails, create_job, estimator_server, metadata_server, stub_of

INVALID = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION
SHAPES = ((1, 1, 128), (2, 1, 256), (4, 1, 1024), (8, 2, 2048))  # gpus, nodes, batch: compute-bound (fully cached)


@pytest.fixture(scope="module")
def stub() -> Iterator[estimator_pb2_grpc.EstimatorServiceStub]:
    with estimator_server() as server:
        yield stub_of(server)


def typed_query(job_id: str, gpu_type: str, application: str = "cifar10") -> estimator_pb2.PredictQuery:
    return estimator_pb2.PredictQuery(job_id=job_id, application=application, candidates=[
        estimator_pb2.CandidateAllocation(gpus=g, nodes=n, cache_bytes=10**13, remote_io_bytes_per_s=10**12,
                                          batch_size=b, gpu_type=gpu_type) for g, n, b in SHAPES])


def rates(stub, job_id: str, gpu_type: str, field: str = "compute_samples_per_s") -> np.ndarray:
    answer = stub.Predict(estimator_pb2.PredictRequest(queries=[typed_query(job_id, gpu_type)]), timeout=10)
    return np.array([getattr(p, field) for p in answer.results[0].predictions])


def in_process(model: JobModel, reference: JobModel, field: str = "compute_samples_per_s") -> np.ndarray:
    gpus, nodes, batch = (np.array(column) for column in zip(*SHAPES))
    predicted = predict([model, reference], 0, gpus, nodes, 1e13, 1e12, batch, base_index=1)
    return getattr(predicted, field)


def measured(perf, gpus: int, nodes: int, batch: int) -> float:
    return float(step_time(perf, nodes, gpus, batch / gpus))


def step_report(perf, gpus: int, nodes: int, batch: int, gpu_type: str, *, with_sync: bool) -> estimator_pb2.StepObservation:
    step = measured(perf, gpus, nodes, batch)
    sync = step - (perf.alpha_c + perf.beta_c * batch / gpus) if with_sync and gpus > 1 else 0.0
    return estimator_pb2.StepObservation(gpus=gpus, nodes=nodes, batch_size=batch, step_time_s=step, sync_time_s=sync,
                                         gpu_type=gpu_type)


def test_the_gpu_type_rule_is_the_metadata_services() -> None:
    assert GPU_TYPE_PATTERN.pattern == METADATA_GPU_TYPE_PATTERN.pattern


def test_unobserved_types_are_predicted_from_the_table_or_the_reference(stub) -> None:
    profile = JobModel.from_profile("cifar10")
    untyped = rates(stub, "", "")
    np.testing.assert_allclose(untyped, in_process(profile, profile))
    np.testing.assert_array_equal(rates(stub, "", "v100"), untyped)  # the reference type
    np.testing.assert_array_equal(rates(stub, "", "h100"), untyped)  # not in the table: unscaled
    k80 = typed_models(profile, ["k80"])["k80"]
    assert application_speed("cifar10", "k80") < 1
    np.testing.assert_allclose(rates(stub, "", "k80"), in_process(k80, profile), rtol=1e-12)
    assert np.all(rates(stub, "", "k80") < untyped)
    # Speedups of every type are over one GPU of the reference type, so they compare across types.
    np.testing.assert_allclose(rates(stub, "", "k80", "speedup"), in_process(k80, profile, "speedup"), rtol=1e-12)
    assert np.all(rates(stub, "", "k80", "speedup") < rates(stub, "", "", "speedup"))


def test_observations_fit_each_type_and_leave_the_others(stub) -> None:
    job = "job-typed-1"
    profile = JobModel.from_profile("cifar10")
    # An "h100" (unknown to the table) computing 3x faster than the reference, with a faster network.
    h100 = profile.perf._replace(alpha_c=profile.perf.alpha_c / 3, beta_c=profile.perf.beta_c / 3,
                                 alpha_r=profile.perf.alpha_r / 2, beta_r=profile.perf.beta_r / 2)
    # This job's K80s are 40 % slower than Gavel's table says for its family.
    k80_table = typed_models(profile, ["k80"])["k80"].perf
    k80 = k80_table._replace(alpha_c=k80_table.alpha_c * 1.4, beta_c=k80_table.beta_c * 1.4)
    truth_h100 = np.array([b / measured(h100, g, n, b) for g, n, b in SHAPES])
    truth_k80 = np.array([b / measured(k80, g, n, b) for g, n, b in SHAPES])
    before_untyped, before_h100, before_k80 = (rates(stub, job, t) for t in ("", "h100", "k80"))
    assert np.all(np.abs(before_h100 / truth_h100 - 1) > 0.3) and np.all(np.abs(before_k80 / truth_k80 - 1) > 0.1)

    # One single-GPU step on the h100 bootstraps its speed (Sia's few points) ...
    one = stub.Observe(estimator_pb2.ObserveRequest(job_id=job, application="cifar10", observations=[
        step_report(h100, 1, 1, 128, "h100", with_sync=True)]), timeout=30).model
    assert one.params[type_key("h100", SPEED_KEY)] == pytest.approx(3.0, rel=1e-6)
    assert rates(stub, job, "h100")[0] == pytest.approx(truth_h100[0], rel=1e-6)
    # ... and enough shapes fit its own model, faster network included.
    stub.Observe(estimator_pb2.ObserveRequest(job_id=job, observations=[
        step_report(h100, g, n, b, "h100", with_sync=True) for g, n, b in SHAPES]), timeout=30)
    after_h100 = rates(stub, job, "h100")
    np.testing.assert_allclose(after_h100, truth_h100, rtol=0.03)

    # Steps on the k80 without sync times (as the live scheduler reports them) move the k80 model.
    reply = stub.Observe(estimator_pb2.ObserveRequest(job_id=job, observations=[
        step_report(k80, 2, 1, 256, "k80", with_sync=False)] * 2), timeout=30).model
    assert reply.params[type_key("k80", SPEED_KEY)] == pytest.approx(application_speed("cifar10", "k80") / 1.4, rel=0.02)
    after_k80 = rates(stub, job, "k80")
    assert after_k80[1] == pytest.approx(truth_k80[1], rel=1e-6)
    np.testing.assert_allclose(after_k80, truth_k80, rtol=0.05)

    # The reference model saw none of it; the h100 fit did not move with the k80's.
    np.testing.assert_array_equal(rates(stub, job, ""), before_untyped)
    np.testing.assert_array_equal(rates(stub, job, "h100"), after_h100)
    model = stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10)
    assert model == reply and model.observations == 1 + len(SHAPES) + 2
    assert [model.params[k] for k in PERF_KEYS] == pytest.approx(list(profile.perf))
    # What the scheduler reads back from the params is what the service predicts with.
    fitted = fitted_type_models(profile, dict(model.params))
    assert set(fitted) == {"h100", "k80"}
    np.testing.assert_allclose(rates(stub, job, "h100"), in_process(fitted["h100"], profile), rtol=1e-9)
    # And the same as the in-process per-type fit of the same steps.
    typed = TypedModels(profile)
    typed.observe("h100", [1], [1], [128], [measured(h100, 1, 1, 128)], [0.0])
    for g, n, b in SHAPES:
        report = step_report(h100, g, n, b, "h100", with_sync=True)
        typed.observe("h100", [g], [n], [b], [report.step_time_s], [report.sync_time_s])
    assert typed.model_on("h100").perf == pytest.approx(fitted["h100"].perf, rel=1e-6)


def test_mixed_types_in_one_call_and_the_reference_type(stub) -> None:
    job = "job-typed-2"
    profile = JobModel.from_profile("bert")
    slower = profile.perf._replace(alpha_c=profile.perf.alpha_c * 2, beta_c=profile.perf.beta_c * 2)
    reports = [estimator_pb2.StepObservation(gpus=1, nodes=1, batch_size=12, step_time_s=measured(slower, 1, 1, 12),
                                             gpu_type=gpu_type) for gpu_type in ("l4", "v100", "l4", "")]
    model = stub.Observe(estimator_pb2.ObserveRequest(job_id=job, application="bert", observations=reports), timeout=30).model
    # "v100" and "" both refit the reference model; "l4" got a model of its own.
    assert {re.match(r"type\[([^\]]+)\]", k)[1] for k in model.params if k.startswith("type[")} == {"l4"}
    assert model.params["perf.beta_c_s_per_sample"] > profile.perf.beta_c * 1.2
    # Speeds are relative to the (refitted) reference: the l4 measured what the reference did.
    assert model.params[type_key("l4", SPEED_KEY)] == pytest.approx(1.0, rel=0.05)


def test_bad_gpu_types_are_refused_naming_the_field(stub) -> None:
    query = typed_query("", "v100")
    query.candidates[2].gpu_type = "V100"
    details = assert_fails(lambda: stub.Predict(estimator_pb2.PredictRequest(queries=[typed_query("", ""), query]), timeout=10),
                           INVALID, "queries[1].candidates[2].gpu_type")
    assert "'V100'" in details and "lower case" in details
    for bad in ("a 100", "-a100", "x" * 33):
        report = estimator_pb2.StepObservation(gpus=1, nodes=1, batch_size=128, step_time_s=1.0, gpu_type=bad)
        assert_fails(lambda r=report: stub.Observe(estimator_pb2.ObserveRequest(
            job_id="job-typed-bad", application="cifar10", observations=[r]), timeout=10), INVALID, "observations[0].gpu_type")
    # A job keeps models for at most MAX_GPU_TYPES_PER_JOB types besides the reference.
    many = [f"t{i}" for i in range(MAX_GPU_TYPES_PER_JOB + 1)]
    reports = [estimator_pb2.StepObservation(gpus=1, nodes=1, batch_size=128 + 8 * i, step_time_s=0.5, gpu_type=t)
               for i, t in enumerate(many)]
    details = assert_fails(lambda: stub.Observe(estimator_pb2.ObserveRequest(
        job_id="job-typed-many", application="cifar10", observations=reports), timeout=10), FAILED,
        f"observations[{MAX_GPU_TYPES_PER_JOB}].gpu_type")
    assert many[-1] in details
    # Nothing was kept from the refused call; the same types within the limit are fine.
    assert_fails(lambda: stub.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-typed-many"), timeout=10),
                 grpc.StatusCode.NOT_FOUND, "job_id")
    stub.Observe(estimator_pb2.ObserveRequest(job_id="job-typed-many", application="cifar10",
                                              observations=reports[:-1]), timeout=30)


def test_every_type_and_the_logs_fit_the_metadata_limit(stub) -> None:
    job = "job-typed-full"
    types = [f"t{i}" for i in range(MAX_GPU_TYPES_PER_JOB)] + [""]
    for round_ in range(5):  # 5 configurations per type, 45 in all: the logs share what is left
        reports = [estimator_pb2.StepObservation(gpus=1, nodes=1, batch_size=64 + 8 * round_, step_time_s=0.3 + 0.01 * i,
                                                 gpu_type=t) for i, t in enumerate(types)]
        model = stub.Observe(estimator_pb2.ObserveRequest(job_id=job, application="ncf", observations=reports), timeout=30).model
    assert len(model.params) <= MAX_PARAMS
    logs = {}
    for key in model.params:
        found = re.fullmatch(r"(?:type\[([^\]]+)\]\.)?obs\.(\d+)\.step_time_s", key)
        if found:
            logs.setdefault(found[1] or "", set()).add(found[2])
    assert set(logs) == set(types) and min(map(len, logs.values())) >= 2  # each type keeps some


def test_typed_models_persist_through_the_metadata_service(tmp_path: Path) -> None:
    metadata = metadata_server(tmp_path / "metadata.db")
    try:
        job = create_job(metadata)
        profile = JobModel.from_profile("cifar10")
        faster = profile.perf._replace(alpha_c=profile.perf.alpha_c / 2, beta_c=profile.perf.beta_c / 2)
        with estimator_server(metadata_address=metadata.address) as first, estimator_server(metadata_address=metadata.address) as second:
            one, two = stub_of(first), stub_of(second)
            one.Observe(estimator_pb2.ObserveRequest(job_id=job, application="cifar10", observations=[
                step_report(faster, g, n, b, "a100", with_sync=True) for g, n, b in SHAPES]), timeout=30)
            # Another estimator reads the per-type models back and predicts the same on every type.
            for gpu_type in ("a100", "", "k80"):
                request = estimator_pb2.PredictRequest(queries=[typed_query(job, gpu_type, application="")])
                assert two.Predict(request, timeout=10) == one.Predict(request, timeout=10)
            assert rates(two, job, "a100")[0] == pytest.approx(2 * rates(two, job, "")[0], rel=0.02)
    finally:
        metadata.stop()


def test_speed_from_whole_steps_inverts_the_scaled_model() -> None:
    reference = JobModel.from_profile("imagenet")
    for speed in (0.2, 1.0, 4.0):
        scaled = reference.perf._replace(alpha_c=reference.perf.alpha_c / speed, beta_c=reference.perf.beta_c / speed)
        nodes, gpus, local = np.array([1, 1, 2]), np.array([2, 4, 8]), np.array([32, 64, 16])
        steps = step_time(scaled, nodes, gpus, local)
        assert speed_from_step_times(reference, nodes, gpus, local, [0, 0, 0], steps) == pytest.approx(speed, rel=1e-9)
    with pytest.raises(ValueError):
        speed_from_step_times(reference, [1], [2], [32], [0], [0.0])


def test_steps_no_compute_speed_explains_get_the_types_own_fit() -> None:
    # Two GPUs of cifar10 spend most of a step synchronising: a step at twice the reference's
    # throughput is faster than its synchronisation alone, so scaling compute cannot explain it.
    reference = JobModel.from_profile("cifar10")
    step = float(step_time(reference.perf, 1, 2, 64)) / 2
    typed = TypedModels(reference)
    model = typed.observe("a100", [2], [1], [128], [step], [0.0])
    assert typed.speeds["a100"] == pytest.approx(MAX_SPEED)
    assert float(step_time(model.perf, 1, 2, 64)) == pytest.approx(step, rel=1e-3)
