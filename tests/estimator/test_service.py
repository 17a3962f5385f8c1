"""EstimatorService over real gRPC, served in-process by start_server on its own event loop thread.

Predict is checked number for number against the in-process estimator; errors for their code
and the field they name; Observe for moving predictions; the metadata-backed store for what it
persists and how it behaves when the metadata service is gone; a hypothesis run for
robustness against random and garbage requests.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator import service
from estimator.goodput import step_time
from estimator.job_model import JobModel
from estimator.model_store import MAX_LOG_ENTRIES
from estimator.predict import ModelTable, predict
from services.metadata import service as metadata_service
from silod.v1 import common_pb2, estimator_pb2, estimator_pb2_grpc, metadata_pb2, metadata_pb2_grpc
from tests.support.inprocess import InProcessServer
from tests.support.procs import free_port

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


Served = InProcessServer


def estimator_server(**settings: object) -> Served:
    config = service.Settings(log_level="warning", **settings)
    return Served(service.definition(config), config)


def metadata_server(db: Path, port: int = 0) -> Served:
    config = metadata_service.Settings(db=f"sqlite:///{db}", listen=f"127.0.0.1:{port}", log_level="warning")
    return Served(metadata_service.definition(config), config)


def stub_of(server: Served) -> estimator_pb2_grpc.EstimatorServiceStub:
    return estimator_pb2_grpc.EstimatorServiceStub(server.channel)


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


def assert_fails(call: Callable[[], object], code: grpc.StatusCode, field: str | None) -> str:
    got, details = status_of(call)
    assert got == code, f"expected {code.name}, got {got.name}: {details}"
    if field is not None:
        assert details.startswith(f"{field}:"), f"message does not name {field!r}: {details!r}"
    return details


@pytest.fixture(scope="module")
def memory_estimator() -> Iterator[Served]:
    with estimator_server() as server:
        yield server


@pytest.fixture(scope="module")
def stub(memory_estimator: Served) -> estimator_pb2_grpc.EstimatorServiceStub:
    return stub_of(memory_estimator)


def query(application: str = "cifar10", job_id: str = "", candidates: tuple = ((4, 0, 0, 10**9, 0),), **fields: int) -> estimator_pb2.PredictQuery:
    return estimator_pb2.PredictQuery(
        job_id=job_id,
        application=application,
        candidates=[
            estimator_pb2.CandidateAllocation(gpus=g, nodes=n, cache_bytes=c, remote_io_bytes_per_s=b, batch_size=s)
            for g, n, c, b, s in candidates
        ],
        **fields,
    )


def obs(**fields: float) -> estimator_pb2.StepObservation:
    values = {"gpus": 4, "nodes": 1, "batch_size": 512, "step_time_s": 0.5, "sync_time_s": 0.1, "cache_hit_ratio": 0.5}
    values.update(fields)
    return estimator_pb2.StepObservation(**values)


# --- Predict ----------------------------------------------------------------------------------

PREDICTION_FIELDS = [f.name for f in estimator_pb2.Prediction.DESCRIPTOR.fields]


def _random_candidates(rng: np.random.Generator, count: int, dataset_bytes: float) -> list[tuple[int, int, int, int, int]]:
    gpus = rng.choice([0, 1, 2, 3, 4, 8, 16, 33, 64], count)
    spread = (gpus > 0) & (rng.random(count) < 0.5)
    nodes = np.where(spread, rng.integers(1, np.maximum(gpus, 1) + 1), 0)
    cache = (rng.choice([0.0, 0.3, 1.0, 1.5], count) * dataset_bytes).astype(np.int64)
    io = rng.choice([0, 10**6, 10**8, 10**10], count)
    batch = rng.choice([0, 0, 64, 1000, 5000], count)
    return list(zip(*(column.tolist() for column in (gpus, nodes, cache, io, batch))))


@pytest.mark.parametrize("gpus_per_node", [4, 8])
def test_predict_batch_equals_the_in_process_estimator(gpus_per_node: int) -> None:
    rng = np.random.default_rng(gpus_per_node)
    apps = ["cifar10", "bert", "imagenet", "ncf", "yolov3", "deepspeech2", "cifar10"]
    queries, models = [], []
    for i, app in enumerate(apps):
        model = JobModel.from_profile(app)
        overrides = {"dataset_bytes": 7 * 10**9, "bytes_per_sample": 5000} if i == len(apps) - 1 else {}
        if overrides:
            model = model.with_dataset(**overrides)
        candidates = _random_candidates(rng, 40, model.dataset_bytes)
        queries.append(query(app, f"job-{i}", tuple(candidates), **overrides))
        models.append((model, candidates))
    with estimator_server(gpus_per_node=gpus_per_node) as server:
        response = stub_of(server).Predict(estimator_pb2.PredictRequest(queries=queries), timeout=30)

    index = np.repeat(np.arange(len(models)), [len(c) for _, c in models])
    g, n, c, b, s = np.array([row for _, rows in models for row in rows]).T
    expected = predict([m for m, _ in models], index, g, n, c.astype(float), b.astype(float), s, gpus_per_node=gpus_per_node)
    assert [r.job_id for r in response.results] == [f"job-{i}" for i in range(len(apps))]
    got = [p for r in response.results for p in r.predictions]
    assert len(got) == len(expected)
    for name in PREDICTION_FIELDS:
        values = np.array([getattr(p, name) for p in got])
        np.testing.assert_array_equal(values, getattr(expected, name), err_msg=name)  # doubles travel exactly
    io_bound = np.array([p.io_bound_samples_per_s for p in got])
    assert np.isinf(io_bound).any() and np.isfinite(io_bound).any()  # +inf is sent as a double


def test_predict_edge_cases(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    empty = stub.Predict(estimator_pb2.PredictRequest(), timeout=10)
    assert len(empty.results) == 0
    no_candidates = stub.Predict(estimator_pb2.PredictRequest(queries=[query(candidates=())]), timeout=10)
    assert len(no_candidates.results) == 1 and len(no_candidates.results[0].predictions) == 0
    mixed = stub.Predict(estimator_pb2.PredictRequest(queries=[query(candidates=()), query(job_id="job-x.1_Z", candidates=((1, 0, 0, 0, 0), (2, 0, 0, 0, 0))), query(candidates=())]), timeout=10)
    assert [(r.job_id, len(r.predictions)) for r in mixed.results] == [("", 0), ("job-x.1_Z", 2), ("", 0)]
    with pytest.raises(grpc.RpcError) as not_an_id:  # job ids are ASCII identifiers (silod/rpc/identifiers.py)
        stub.Predict(estimator_pb2.PredictRequest(queries=[query(candidates=()), query(job_id="job-ü")]), timeout=10)
    assert not_an_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not_an_id.value.details().startswith("queries[1].job_id: a job id may not contain 'ü'")
    zero_gpus = stub.Predict(estimator_pb2.PredictRequest(queries=[query(candidates=((0, 0, 0, 10**9, 0),))]), timeout=10)
    p = zero_gpus.results[0].predictions[0]
    assert p.throughput_samples_per_s == 0 and p.goodput_samples_per_s == 0 and p.batch_size == 0
    one_gpu = stub.Predict(estimator_pb2.PredictRequest(queries=[query(candidates=((1, 0, 10**15, 0, 0),))]), timeout=10)
    assert one_gpu.results[0].predictions[0].speedup == pytest.approx(1.0)  # the base allocation, fully cached


@pytest.mark.parametrize(
    "queries, code, field",
    [
        ([query(), query("no-such-app")], NOT_FOUND, "queries[1].application"),
        ([query(application="", job_id="job-never-seen")], NOT_FOUND, "queries[0].job_id"),
        ([query(application="")], INVALID, "queries[0].application"),
        ([query(job_id="j" * 65)], INVALID, "queries[0].job_id"),
        ([query(application="a" * 129)], INVALID, "queries[0].application"),
        ([query(dataset_bytes=-1)], INVALID, "queries[0].dataset_bytes"),
        ([query(bytes_per_sample=-5)], INVALID, "queries[0].bytes_per_sample"),
        ([query(bytes_per_sample=2**41)], INVALID, "queries[0].bytes_per_sample"),
        ([query()] * 3 + [query(candidates=((1, 0, 0, 0, 0),) * 2 + ((-1, 0, 0, 0, 0),))], INVALID, "queries[3].candidates[2].gpus"),
        ([query(candidates=((100_001, 0, 0, 0, 0),))], INVALID, "queries[0].candidates[0].gpus"),
        ([query(candidates=((4, 0, 0, 0, 0), (4, 5, 0, 0, 0)))], INVALID, "queries[0].candidates[1].nodes"),
        ([query(candidates=((0, 1, 0, 0, 0),))], INVALID, "queries[0].candidates[0].nodes"),
        ([query(candidates=((4, -1, 0, 0, 0),))], INVALID, "queries[0].candidates[0].nodes"),
        ([query(candidates=((4, 0, -1, 0, 0),))], INVALID, "queries[0].candidates[0].cache_bytes"),
        ([query(candidates=((4, 0, 2**61, 0, 0),))], INVALID, "queries[0].candidates[0].cache_bytes"),
        ([query(candidates=((4, 0, 0, -7, 0),))], INVALID, "queries[0].candidates[0].remote_io_bytes_per_s"),
        ([query(candidates=((4, 0, 0, 2**62, 0),))], INVALID, "queries[0].candidates[0].remote_io_bytes_per_s"),
        ([query(candidates=((4, 0, 0, 0, -3),))], INVALID, "queries[0].candidates[0].batch_size"),
        ([query(candidates=((4, 0, 0, 0, 2**31 - 1),))], INVALID, "queries[0].candidates[0].batch_size"),
    ],
)
def test_predict_rejects_bad_queries(stub: estimator_pb2_grpc.EstimatorServiceStub, queries: list, code: grpc.StatusCode, field: str) -> None:
    assert_fails(lambda: stub.Predict(estimator_pb2.PredictRequest(queries=queries), timeout=10), code, field)


def test_predict_limits_candidates_per_call(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    request = estimator_pb2.PredictRequest(queries=[query(candidates=((1, 0, 0, 0, 0),) * 100_001)] * 2)
    details = assert_fails(lambda: stub.Predict(request, timeout=30), INVALID, "queries")
    assert "200000" in details and "200002" in details


# --- Observe / GetJobModel -------------------------------------------------------------------


def test_observe_refits_and_moves_predictions_toward_observed_step_times(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    profile = JobModel.from_profile("cifar10")
    # This job's GPUs are 2.5x slower than the profile's.
    truth = profile.perf._replace(alpha_c=profile.perf.alpha_c * 2.5, beta_c=profile.perf.beta_c * 2.5)
    shapes = [(1, 1, 128), (1, 1, 512), (4, 1, 512), (4, 1, 2048), (8, 2, 1024), (8, 2, 4096)]
    reports = []
    for gpus, nodes, batch in shapes:
        local = batch / gpus
        step = float(step_time(truth, nodes, gpus, local))
        sync = step - (truth.alpha_c + truth.beta_c * local) if gpus > 1 else 0.0
        reports.append(obs(gpus=gpus, nodes=nodes, batch_size=batch, step_time_s=step, sync_time_s=sync, grad_sqr=0.2, grad_var=6.0))
    candidates = tuple((g, n, 10**12, 10**12, b) for g, n, b in shapes)  # fully cached: compute bound
    request = estimator_pb2.PredictRequest(queries=[query("cifar10", "job-slow", candidates)])
    observed = np.array([b / float(step_time(truth, n, g, b / g)) for g, n, b in shapes])

    before = np.array([p.compute_samples_per_s for p in stub.Predict(request, timeout=10).results[0].predictions])
    answer = stub.Observe(estimator_pb2.ObserveRequest(job_id="job-slow", application="cifar10", observations=reports), timeout=30)
    after = np.array([p.compute_samples_per_s for p in stub.Predict(request, timeout=10).results[0].predictions])

    assert np.all(np.abs(after - observed) < 0.5 * np.abs(before - observed))
    np.testing.assert_allclose(after, observed, rtol=0.05)
    model = answer.model
    assert model.job_id == "job-slow" and model.application == "cifar10" and model.observations == len(shapes)
    assert model.params["grad.sqr_norm2"] == pytest.approx(0.2) and model.params["grad.var_norm2"] == pytest.approx(6.0)
    assert model.params["perf.beta_c_s_per_sample"] == pytest.approx(truth.beta_c, rel=0.1)
    assert stub.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-slow"), timeout=10) == model
    # job_id alone now suffices, and the fitted model wins over the application named.
    only_id = estimator_pb2.PredictRequest(queries=[query("", "job-slow", candidates), query("bert", "job-slow", candidates)])
    for result in stub.Predict(only_id, timeout=10).results:
        np.testing.assert_array_equal([p.compute_samples_per_s for p in result.predictions], after)


def test_observe_accumulates_and_keeps_the_log_within_the_store_limit(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    batches = list(range(64, 64 + 40 * 8, 8))  # 40 distinct configurations, each reported twice
    total = 0
    for chunk in (batches[:30], batches[30:]):
        reports = [obs(batch_size=b) for b in chunk for _ in range(2)]
        reply = stub.Observe(estimator_pb2.ObserveRequest(job_id="job-many", application="ncf", observations=reports), timeout=30)
        total += len(reports)
    params = reply.model.params
    assert reply.model.observations == total
    entries = {key.split(".")[1] for key in params if key.startswith("obs.")}
    assert len(entries) == MAX_LOG_ENTRIES and len(params) <= 256
    assert params[f"obs.{MAX_LOG_ENTRIES - 1}.local_bsz_samples"] == (64 + 39 * 8) / 4  # the newest is kept last


def test_concurrent_observes_of_one_job_are_all_counted(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    from concurrent.futures import ThreadPoolExecutor

    request = estimator_pb2.ObserveRequest(job_id="job-busy", application="yolov3", observations=[obs(batch_size=64), obs(batch_size=128)])
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: stub.Observe(request, timeout=60), range(8)))
    assert sorted(r.model.observations for r in replies) == list(range(2, 17, 2))
    assert stub.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-busy"), timeout=10).observations == 16


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"gpus": 0}, "observations[1].gpus"),
        ({"gpus": 100_001, "nodes": 1}, "observations[1].gpus"),
        ({"nodes": 0}, "observations[1].nodes"),
        ({"nodes": 5}, "observations[1].nodes"),
        ({"batch_size": 0}, "observations[1].batch_size"),
        ({"batch_size": 3}, "observations[1].batch_size"),
        ({"step_time_s": 0.0}, "observations[1].step_time_s"),
        ({"step_time_s": -1.0}, "observations[1].step_time_s"),
        ({"step_time_s": math.nan}, "observations[1].step_time_s"),
        ({"step_time_s": math.inf}, "observations[1].step_time_s"),
        ({"sync_time_s": -0.1}, "observations[1].sync_time_s"),
        ({"sync_time_s": 0.6}, "observations[1].sync_time_s"),
        ({"sync_time_s": math.nan}, "observations[1].sync_time_s"),
        ({"cache_hit_ratio": 1.5}, "observations[1].cache_hit_ratio"),
        ({"cache_hit_ratio": -0.1}, "observations[1].cache_hit_ratio"),
        ({"grad_sqr": -1.0}, "observations[1].grad_sqr"),
        ({"grad_var": math.inf}, "observations[1].grad_var"),
    ],
)
def test_observe_rejects_bad_observations(stub: estimator_pb2_grpc.EstimatorServiceStub, fields: dict, field: str) -> None:
    request = estimator_pb2.ObserveRequest(job_id="job-bad", application="bert", observations=[obs(), obs(**fields)])
    assert_fails(lambda: stub.Observe(request, timeout=10), INVALID, field)
    assert_fails(lambda: stub.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-bad"), timeout=10), NOT_FOUND, "job_id")


def test_every_bad_observation_and_query_is_reported_at_once(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    from silod.rpc.errors import field_violations

    request = estimator_pb2.ObserveRequest(job_id="job-bad", application="bert",
                                           observations=[obs(gpus=0), obs(), obs(cache_hit_ratio=2.0, grad_var=-1.0)])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Observe(request, timeout=10)
    assert [v.field for v in field_violations(refused.value)] == [
        "observations[0].gpus", "observations[2].cache_hit_ratio", "observations[2].grad_var"]
    bad = estimator_pb2.PredictRequest(queries=[query(dataset_bytes=-1, candidates=((-1, 0, 0, 0, 0), (1, 0, -5, 0, 0)))])
    with pytest.raises(grpc.RpcError) as refused:
        stub.Predict(bad, timeout=10)
    assert [v.field for v in field_violations(refused.value)] == [
        "queries[0].dataset_bytes", "queries[0].candidates[0].gpus", "queries[0].candidates[1].cache_bytes"]


def test_observe_and_get_job_model_errors(stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    def observe(job_id: str, application: str, observations: list | None = None) -> Callable[[], object]:
        request = estimator_pb2.ObserveRequest(job_id=job_id, application=application, observations=[obs()] if observations is None else observations)
        return lambda: stub.Observe(request, timeout=30)

    assert_fails(observe("", "bert"), INVALID, "job_id")
    assert_fails(observe("j" * 65, "bert"), INVALID, "job_id")
    assert_fails(observe("job-first", ""), INVALID, "application")  # first observation, no model known
    assert_fails(observe("job-first", "no-such-app"), NOT_FOUND, "application")
    assert_fails(observe("job-first", "bert", []), INVALID, "observations")
    assert observe("job-first", "bert")() is not None
    assert_fails(observe("job-first", "cifar10"), INVALID, "application")  # modelled as bert
    assert stub.Observe(estimator_pb2.ObserveRequest(job_id="job-first", observations=[obs()]), timeout=30).model.observations == 2
    assert_fails(lambda: stub.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-other"), timeout=10), NOT_FOUND, "job_id")
    assert_fails(lambda: stub.GetJobModel(common_pb2.GetJobModelRequest(), timeout=10), INVALID, "job_id")


def test_health_answers_while_a_large_predict_runs(memory_estimator: Served, stub: estimator_pb2_grpc.EstimatorServiceStub) -> None:
    rng = np.random.default_rng(1)
    queries = [query(app, "", tuple(_random_candidates(rng, 100, 10**10))) for app in ["imagenet", "bert", "ncf", "yolov3"] * 250]
    request = estimator_pb2.PredictRequest(queries=queries)  # 100,000 candidates
    done: list[float] = []
    worker = threading.Thread(target=lambda: done.append(len(stub.Predict(request, timeout=60).results)))
    health = health_pb2_grpc.HealthStub(memory_estimator.channel)
    started = time.perf_counter()
    worker.start()
    latencies = []
    while worker.is_alive():
        start = time.perf_counter()
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        latencies.append(time.perf_counter() - start)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.02)
    worker.join()
    predict_s = time.perf_counter() - started
    assert done == [1000]
    # A health check that queued behind the predict would wait for most of it; relative to the
    # predict's own duration, so a busy machine (slower at both) does not fail it.
    assert len(latencies) >= 3 and max(latencies) < predict_s / 2, (predict_s, latencies)


# --- persistence through the metadata service (in-process servers) ---------------------------


def retry_while_unavailable(call: Callable[[], object], timeout_s: float = 15) -> object:
    """What a client does: the estimator's channel to a restarted metadata service reconnects after a backoff."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def create_job(metadata: Served, application: str = "cifar10") -> str:
    spec = common_pb2.JobSpec(name="j", application=application, min_gpus=1, max_gpus=4, batch_size=128, epochs=1)
    return metadata_pb2_grpc.MetadataServiceStub(metadata.channel).CreateJob(metadata_pb2.CreateJobRequest(spec=spec), timeout=10).id


def test_models_persist_in_the_metadata_service(tmp_path: Path) -> None:
    port = free_port()
    metadata = metadata_server(tmp_path / "metadata.db", port)
    try:
        job, quiet_job = create_job(metadata), create_job(metadata, "bert")
        address = f"127.0.0.1:{port}"
        with estimator_server(metadata_address=address, metadata_timeout_s=2) as first, estimator_server(metadata_address=address) as second:
            one, two = stub_of(first), stub_of(second)
            # Unknown to the metadata service: NOT_FOUND, and nothing is kept.
            assert_fails(lambda: one.Observe(estimator_pb2.ObserveRequest(job_id="job-nope", application="bert", observations=[obs()]), timeout=10), NOT_FOUND, "job_id")
            assert_fails(lambda: one.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-nope"), timeout=10), NOT_FOUND, "job_id")
            assert_fails(lambda: one.GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10), NOT_FOUND, "job_id")

            request = estimator_pb2.ObserveRequest(job_id=job, application="cifar10", observations=[obs(step_time_s=1.5, sync_time_s=0.2)])
            model = one.Observe(request, timeout=30).model
            stored = metadata_pb2_grpc.MetadataServiceStub(metadata.channel).GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10)
            assert stored == model
            # Another estimator (or this one restarted) reads it back and predicts the same.
            assert two.GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10) == model
            predict_request = estimator_pb2.PredictRequest(queries=[query("", job, ((4, 1, 0, 10**8, 0), (8, 2, 10**9, 10**9, 512)))])
            assert two.Predict(predict_request, timeout=10) == one.Predict(predict_request, timeout=10)

            quiet = estimator_pb2.ObserveRequest(job_id=quiet_job, application="bert", observations=[obs(batch_size=48)])
            assert one.Observe(quiet, timeout=30).model.observations == 1

            # Metadata gone: Observe updates memory, answers UNAVAILABLE, and a retry is not counted twice.
            metadata.stop()
            assert_fails(lambda: one.Observe(quiet, timeout=30), UNAVAILABLE, None)  # persisted at shutdown
            second_request = estimator_pb2.ObserveRequest(job_id=job, observations=[obs(step_time_s=1.4, sync_time_s=0.2)])
            for _ in range(2):
                details = assert_fails(lambda: one.Observe(second_request, timeout=30), UNAVAILABLE, None)
                assert address in details and "memory" in details
                assert one.GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10).observations == 2
            # Predict falls back to the profile when it has an application, else says UNAVAILABLE.
            other = estimator_pb2.PredictRequest(queries=[query("cifar10", "job-elsewhere")])
            assert len(one.Predict(other, timeout=30).results[0].predictions) == 1
            assert_fails(lambda: one.Predict(estimator_pb2.PredictRequest(queries=[query("", "job-elsewhere")]), timeout=30), UNAVAILABLE, "queries[0].job_id")
            assert_fails(lambda: two.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-elsewhere"), timeout=30), UNAVAILABLE, None)

            # Back on the same address: the retry persists the change once.
            metadata = metadata_server(tmp_path / "metadata.db", port)
            persisted = retry_while_unavailable(lambda: one.Observe(second_request, timeout=30)).model
            assert persisted.observations == 2
            stored = metadata_pb2_grpc.MetadataServiceStub(metadata.channel).GetJobModel(common_pb2.GetJobModelRequest(job_id=job), timeout=10)
            assert stored == persisted
        # Stopping the estimator wrote what was left in memory only.
        stored = metadata_pb2_grpc.MetadataServiceStub(metadata.channel).GetJobModel(common_pb2.GetJobModelRequest(job_id=quiet_job), timeout=10)
        assert stored.observations == 2
    finally:
        metadata.stop()


# --- robustness ---------------------------------------------------------------------------------

_int32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, 70))
_int64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-2, 10**11))
_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 10), st.sampled_from([0.0, 1e-300, 1e300]))
_text = st.one_of(st.sampled_from(["", "cifar10", "bert", "ncf", "job-fuzz-1", "job-fuzz-2", "imagenet"]), st.text(max_size=80))

_gpu_types = st.one_of(st.sampled_from(["", "v100", "k80", "p100", "h100", "a100.80gb"]), st.text(max_size=40))
_sane_gpu_types = st.sampled_from(["", "", "v100", "k80", "p100", "h100"])
_candidates = st.builds(
    estimator_pb2.CandidateAllocation, gpus=_int32, nodes=_int32, cache_bytes=_int64, remote_io_bytes_per_s=_int64,
    batch_size=_int32, gpu_type=_gpu_types,
)
_queries = st.builds(
    estimator_pb2.PredictQuery,
    job_id=_text,
    application=_text,
    dataset_bytes=_int64,
    bytes_per_sample=_int64,
    candidates=st.lists(_candidates, max_size=6),
)
_observations = st.builds(
    estimator_pb2.StepObservation,
    gpus=_int32,
    nodes=_int32,
    batch_size=_int32,
    step_time_s=_float,
    sync_time_s=_float,
    cache_hit_ratio=_float,
    grad_sqr=_float,
    grad_var=_float,
    gpu_type=_gpu_types,
)
_apps = st.sampled_from(["cifar10", "bert", "ncf", "imagenet", "yolov3", "deepspeech2"])
_fuzz_jobs = st.sampled_from(["job-fuzz-1", "job-fuzz-2", "job-fuzz-3"])


@st.composite
def _sane_candidates(draw: st.DrawFn) -> estimator_pb2.CandidateAllocation:
    gpus = draw(st.integers(0, 64))
    return estimator_pb2.CandidateAllocation(
        gpus=gpus,
        nodes=draw(st.integers(0, gpus)),
        cache_bytes=draw(st.one_of(st.just(0), st.integers(0, 2 * 10**11))),
        remote_io_bytes_per_s=draw(st.one_of(st.just(0), st.integers(0, 10**10))),
        batch_size=draw(st.one_of(st.just(0), st.integers(1, 8192))),
        gpu_type=draw(_sane_gpu_types),
    )


@st.composite
def _sane_observations(draw: st.DrawFn) -> estimator_pb2.StepObservation:
    gpus = draw(st.integers(1, 16))
    step = draw(st.floats(0.01, 5))
    return estimator_pb2.StepObservation(
        gpus=gpus,
        nodes=draw(st.integers(1, gpus)),
        batch_size=draw(st.integers(gpus, 4096)),
        step_time_s=step,
        sync_time_s=draw(st.floats(0, step)),
        cache_hit_ratio=draw(st.floats(0, 1)),
        grad_sqr=draw(st.floats(0, 10)),
        grad_var=draw(st.floats(0, 100)),
        gpu_type=draw(_sane_gpu_types),
    )


_sane_queries = st.builds(
    estimator_pb2.PredictQuery,
    job_id=st.one_of(st.just(""), _fuzz_jobs),
    application=_apps,
    dataset_bytes=st.one_of(st.just(0), st.integers(0, 10**12)),
    bytes_per_sample=st.one_of(st.just(0), st.integers(0, 10**6)),
    candidates=st.lists(_sane_candidates(), max_size=8),
)
_observe_calls = st.one_of(
    st.builds(  # near valid: mostly refits (each costs a least-squares fit, so fewer of these)
        lambda j, a, o: ("Observe", estimator_pb2.ObserveRequest(job_id=j, application=a, observations=o)),
        _fuzz_jobs,
        st.one_of(st.just(""), _apps),
        st.lists(_sane_observations(), min_size=1, max_size=4),
    ),
    st.builds(
        lambda j, a, o: ("Observe", estimator_pb2.ObserveRequest(job_id=j, application=a, observations=o)),
        _text,
        _text,
        st.lists(st.one_of(_observations, _sane_observations()), max_size=4),
    ),
)
_calls = st.one_of(
    st.builds(lambda q: ("Predict", estimator_pb2.PredictRequest(queries=q)), st.lists(_sane_queries, max_size=4)),
    st.builds(lambda q: ("Predict", estimator_pb2.PredictRequest(queries=q)), st.lists(st.one_of(_queries, _sane_queries), max_size=4)),
    _observe_calls,
    st.builds(lambda j: ("GetJobModel", common_pb2.GetJobModelRequest(job_id=j)), st.one_of(_text, _fuzz_jobs)),
)
CLIENT_ERRORS = {OK, INVALID, NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(call=_calls)
def test_random_and_garbage_requests_get_ok_or_client_errors(memory_estimator: Served, call: tuple[str, object]) -> None:
    method, request = call
    stub = stub_of(memory_estimator)
    try:
        reply = getattr(stub, method)(request, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, f"{method} -> {exc.code().name}: {exc.details()}\n{request}"
        assert ":" in (exc.details() or "")
        return
    if method == "Predict":
        for result in reply.results:
            for p in result.predictions:
                values = [getattr(p, name) for name in PREDICTION_FIELDS]
                assert not any(math.isnan(v) for v in values), p
                assert all(v >= 0 for v in values), p
                assert math.isfinite(p.compute_samples_per_s) and math.isfinite(p.goodput_samples_per_s), p


def test_server_still_serves_after_the_fuzz(memory_estimator: Served) -> None:
    reply = health_pb2_grpc.HealthStub(memory_estimator.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert len(stub_of(memory_estimator).Predict(estimator_pb2.PredictRequest(queries=[query()]), timeout=10).results) == 1
