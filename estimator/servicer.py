"""``silod.v1.EstimatorService`` over gRPC: validation, model lookup, batch prediction, refits.

Predict answers every candidate of every query with ONE vectorized
:func:`estimator.predict.predict` call. A query is predicted with the job's fitted model when
``job_id`` is known (in memory, else in the metadata service) and with its application's
profile otherwise; a candidate's ``gpu_type`` picks the job's model on that type
(:meth:`estimator.model_store.JobRecord.model_on`). Observe folds step reports into the job's
model on the type they ran on (:class:`estimator.per_type.TypedModels`) and persists it;
GetJobModel reads it back.

CPU-heavy work (reading the request into arrays, predicting, building the answer, fitting)
runs in worker threads so the event loop keeps answering health checks and small calls.
Errors name the offending field, e.g. ``queries[3].candidates[2].gpus: must be >= 0, got -1``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from estimator.goodput import split_local_batch
from estimator.gpu_types import gpu_type_problem, typed_models
from estimator.job_model import JobModel
from estimator.model_store import (
    MAX_GPU_TYPES_PER_JOB,
    JobRecord,
    MetadataRefused,
    MetadataUnavailable,
    ModelStore,
    UnknownJob,
    UnusableRecord,
    log_budget,
    mark_recent,
    trim_logs,
)
from estimator.per_type import is_reference
from estimator.predict import DEFAULT_GPUS_PER_NODE, ModelTable, Predictions, predict
from estimator.profiles import application_names
from services.runtime.downstream import translate
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, Problems, Unavailable
from silod.rpc.errors import MAX_VIOLATIONS
from silod.rpc.identifiers import JOB_ID, problem
from services.runtime.structured_logging import get_logger
from silod.v1 import common_pb2, estimator_pb2, estimator_pb2_grpc

_log = get_logger("silod.estimator")

# Limits of one call. Values beyond them are mistakes, not workloads.
MAX_QUERIES = 100_000
MAX_CANDIDATES = 200_000  # candidates summed over all queries of one Predict
MAX_OBSERVATIONS = 10_000  # observations of one Observe
MAX_GPUS = 100_000
MAX_BATCH_SIZE = 10_000_000  # samples per step
MAX_DATASET_BYTES = 2**60  # 1 EiB; also the largest cache grant
MAX_SAMPLE_BYTES = 2**40
MAX_IO_BYTES_PER_S = 2**50  # 1 PiB/s
MAX_STEP_TIME_S = 1e6
MAX_GRAD_STAT = 1e100
MAX_APPLICATION_CHARS = 128
LOOKUP_CONCURRENCY = 32  # GetJobModel calls in flight for one Predict


@functools.lru_cache(maxsize=1)
def known_applications() -> frozenset[str]:
    return frozenset(application_names())


def warm_profiles(stop: threading.Event | None = None) -> None:
    """Load and fit every packaged profile once, so the first Predict does not pay for it.

    Returns early once ``stop`` is set (checked between profiles).
    """
    for application in sorted(known_applications()):
        if stop is not None and stop.is_set():
            return
        JobModel.from_profile(application)


# --- validation helpers -------------------------------------------------------------------


def _check_job_id(value: str, field: str, *, required: bool) -> str:
    """The runtime already refused malformed job ids (silod/rpc/identifiers.py); this adds "required"."""
    found = problem(JOB_ID, value, required=required)
    if found is not None:
        raise InvalidArgument(found, field=field)
    return value


def _check_application(value: str, field: str) -> str:
    if len(value) > MAX_APPLICATION_CHARS:
        raise InvalidArgument(f"must be at most {MAX_APPLICATION_CHARS} characters, got {len(value)}", field=field)
    return value


def _check_int(value: int, field: str, low: int, high: int, high_name: str = "") -> None:
    if value < low:
        raise InvalidArgument(f"must be >= {low}, got {value}", field=field)
    if value > high:
        raise InvalidArgument(f"must be at most {high_name or high}, got {value}", field=field)


def _check_float(value: float, field: str, low: float, high: float, *, low_open: bool = False, high_name: str = "") -> None:
    if not math.isfinite(value):
        raise InvalidArgument(f"must be a finite number, got {value}", field=field)
    if value < low or (low_open and value == low):
        raise InvalidArgument(f"must be {'>' if low_open else '>='} {low:g}, got {value:g}", field=field)
    if value > high:
        raise InvalidArgument(f"must be at most {high_name or format(high, 'g')}, got {value:g}", field=field)


def _application_model(application: str, field: str) -> JobModel:
    if not application:
        raise InvalidArgument("required unless job_id names a job with a fitted model", field=field)
    if application not in known_applications():
        known = ", ".join(sorted(known_applications()))
        raise NotFound(f"no profile for application {application!r}; known: {known}", field=field)
    return JobModel.from_profile(application)


# --- Predict --------------------------------------------------------------------------------


@dataclass
class _Batch:
    """A validated PredictRequest as arrays: per query, and per candidate of all queries."""

    job_ids: list[str]
    applications: list[str]
    dataset_bytes: list[int]
    bytes_per_sample: list[int]
    counts: np.ndarray  # candidates per query
    gpus: np.ndarray
    nodes: np.ndarray
    cache_bytes: np.ndarray
    remote_io_bytes_per_s: np.ndarray
    batch_size: np.ndarray
    gpu_types: list[str] = dataclasses.field(default_factory=lambda: [""])  # distinct types; [0] is "" (untyped)
    type_index: np.ndarray | None = None  # per candidate: its gpu_types entry; None = all untyped


def _read_batch(request: estimator_pb2.PredictRequest) -> _Batch:
    queries = request.queries
    if len(queries) > MAX_QUERIES:
        raise InvalidArgument(f"at most {MAX_QUERIES} queries per call, got {len(queries)}", field="queries")
    counts = np.fromiter((len(q.candidates) for q in queries), dtype=np.int64, count=len(queries))
    total = int(counts.sum())
    if total > MAX_CANDIDATES:
        raise InvalidArgument(f"at most {MAX_CANDIDATES} candidates per call (all queries together), got {total}", field="queries")
    job_ids, applications, dataset_bytes, bytes_per_sample = [], [], [], []
    problems = Problems()
    check = problems.check
    for i, query in enumerate(queries):
        field = f"queries[{i}]"
        check(_check_job_id, query.job_id, f"{field}.job_id", required=False)
        check(_check_application, query.application, f"{field}.application")
        check(_check_int, query.dataset_bytes, f"{field}.dataset_bytes", 0, MAX_DATASET_BYTES, "2**60")
        check(_check_int, query.bytes_per_sample, f"{field}.bytes_per_sample", 0, MAX_SAMPLE_BYTES, "2**40")
        job_ids.append(query.job_id)
        applications.append(query.application)
        dataset_bytes.append(query.dataset_bytes)
        bytes_per_sample.append(query.bytes_per_sample)

    rows = [
        (c.gpus, c.nodes, c.cache_bytes, c.remote_io_bytes_per_s, c.batch_size)
        for query in queries
        for c in query.candidates
    ]
    columns = np.array(rows, dtype=np.int64).reshape(total, 5).T
    batch = _Batch(job_ids, applications, dataset_bytes, bytes_per_sample, counts, *columns)
    _read_gpu_types(queries, batch, problems)
    _check_candidates(batch, problems)
    problems.raise_if_any()
    return batch


def _read_gpu_types(queries: Sequence[estimator_pb2.PredictQuery], batch: _Batch, problems: Problems) -> None:
    """The candidates' GPU types as indices into ``batch.gpu_types``; each malformed name reported once."""
    types = [c.gpu_type for query in queries for c in query.candidates]
    distinct = dict.fromkeys(types)
    if not distinct or list(distinct) == [""]:
        return
    batch.gpu_types = [""] + [t for t in distinct if t]
    lookup = {name: i for i, name in enumerate(batch.gpu_types)}
    batch.type_index = np.fromiter(map(lookup.__getitem__, types), dtype=np.int64, count=len(types))
    ends = np.cumsum(batch.counts)
    for name in batch.gpu_types:
        found = gpu_type_problem(name)
        if found is not None:
            k = types.index(name)
            query = int(np.searchsorted(ends, k, side="right"))
            problems.add(f"queries[{query}].candidates[{k - int(ends[query] - batch.counts[query])}].gpu_type", found)


def _check_candidates(batch: _Batch, problems: Problems) -> None:
    """Add every candidate field that breaks a rule to ``problems`` (vectorized, rule by rule)."""
    ends = np.cumsum(batch.counts)

    def fail(bad: np.ndarray, name: str, message: str) -> None:
        found = np.flatnonzero(bad)
        for k in found[:MAX_VIOLATIONS].tolist():
            query = int(np.searchsorted(ends, k, side="right"))
            candidate = k - int(ends[query] - batch.counts[query])
            value = int(getattr(batch, name)[k])
            problems.add(f"queries[{query}].candidates[{candidate}].{name}",
                         message.format(value=value, gpus=int(batch.gpus[k])))
        problems.omitted += max(0, len(found) - MAX_VIOLATIONS)

    for name, high, high_name in (
        ("gpus", MAX_GPUS, str(MAX_GPUS)),
        ("nodes", MAX_GPUS, str(MAX_GPUS)),
        ("cache_bytes", MAX_DATASET_BYTES, "2**60"),
        ("remote_io_bytes_per_s", MAX_IO_BYTES_PER_S, "2**50"),
        ("batch_size", MAX_BATCH_SIZE, str(MAX_BATCH_SIZE)),
    ):
        values = getattr(batch, name)
        fail(values < 0, name, "must be >= 0, got {value}")
        fail(values > high, name, f"must be at most {high_name}, got {{value}}")
        if name == "nodes":
            fail((batch.nodes > batch.gpus) & (batch.gpus >= 0), "nodes", "must not exceed gpus ({gpus}): every node holds a GPU of the job, got {value}")


class EstimatorServicer(estimator_pb2_grpc.EstimatorServiceServicer):
    def __init__(self, store: ModelStore, *, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> None:
        self._store = store
        self._gpus_per_node = gpus_per_node

    async def Predict(self, request: estimator_pb2.PredictRequest, context: object) -> estimator_pb2.PredictResponse:
        batch = await asyncio.to_thread(_read_batch, request)
        records = await self._lookup_all(batch.job_ids)
        return await asyncio.to_thread(self._answer, batch, records)

    async def _lookup_all(self, job_ids: Sequence[str]) -> dict[str, JobRecord | None | Exception]:
        """Records of the distinct job ids: JobRecord, None (no model anywhere) or the lookup's error."""
        found: dict[str, JobRecord | None | Exception] = {}
        missing = []
        for job_id in dict.fromkeys(job_ids):
            if not job_id:
                continue
            record = self._store.cached(job_id)
            if record is not None or not self._store.persistent:
                found[job_id] = record
            else:
                missing.append(job_id)
        if missing:
            limit = asyncio.Semaphore(LOOKUP_CONCURRENCY)

            async def one(job_id: str) -> JobRecord | None | Exception:
                async with limit:
                    try:
                        return await self._store.lookup(job_id, for_predict=True)
                    except (MetadataUnavailable, MetadataRefused, UnusableRecord) as exc:
                        return exc

            for job_id, result in zip(missing, await asyncio.gather(*(one(j) for j in missing))):
                found[job_id] = result
        return found

    def _answer(self, batch: _Batch, records: dict[str, JobRecord | None | Exception]) -> estimator_pb2.PredictResponse:
        models: dict[JobModel, int] = {}
        query_model = np.empty(len(batch.job_ids), dtype=np.int64)
        fallbacks = []
        owners: list[JobRecord | None] = []  # per query: the record its model came from, None = a profile
        for i, (job_id, application) in enumerate(zip(batch.job_ids, batch.applications)):
            found = records.get(job_id)
            model = self._model_for(i, job_id, application, found, fallbacks)
            owners.append(found if isinstance(found, JobRecord) and found.model is model else None)
            if batch.dataset_bytes[i] or batch.bytes_per_sample[i]:
                model = model.with_dataset(batch.dataset_bytes[i], batch.bytes_per_sample[i])
            query_model[i] = models.setdefault(model, len(models))
        if fallbacks:
            _log.warning(
                "fitted models unavailable, predicted from application profiles",
                extra={"jobs": fallbacks[:10], "job_count": len(fallbacks)},
            )

        if not len(batch.gpus):
            return estimator_pb2.PredictResponse(results=[estimator_pb2.PredictResult(job_id=j) for j in batch.job_ids])
        reference_index = np.repeat(query_model, batch.counts)
        candidate_model = reference_index
        if batch.type_index is not None:
            candidate_model = self._typed_index(batch, owners, list(models), models, reference_index)
        try:
            predicted = predict(
                ModelTable(list(models)),
                candidate_model,
                batch.gpus,
                batch.nodes,
                batch.cache_bytes.astype(np.float64),
                batch.remote_io_bytes_per_s.astype(np.float64),
                batch.batch_size,
                gpus_per_node=self._gpus_per_node,
                base_index=reference_index,
            )
        except ValueError as exc:  # validation above should make this unreachable
            raise InvalidArgument(str(exc), field="queries") from None
        return estimator_pb2.PredictResponse.FromString(encode_results(batch.job_ids, batch.counts, predicted))

    @staticmethod
    def _typed_index(batch: _Batch, owners: list[JobRecord | None], query_models: list[JobModel],
                     models: dict[JobModel, int], reference_index: np.ndarray) -> np.ndarray:
        """Per candidate, the index in ``models`` (extended here) of its job's model on its GPU type."""
        types = len(batch.gpu_types)
        query_of = np.repeat(np.arange(len(batch.job_ids)), batch.counts)
        pairs, inverse = np.unique(query_of * types + batch.type_index, return_inverse=True)
        on_type: dict[tuple[int, str], JobModel] = {}  # (id of a profile model, type) -> its typed model
        chosen = np.empty(len(pairs), dtype=np.int64)
        for p, pair in enumerate(pairs.tolist()):
            query, gpu_type = divmod(pair, types)
            gpu_type = batch.gpu_types[gpu_type]
            reference = query_models[int(reference_index[np.searchsorted(query_of, query)])]
            if is_reference(gpu_type):
                chosen[p] = models[reference]
                continue
            owner = owners[query]
            if owner is not None:
                model = owner.model_on(gpu_type)
            else:
                key = (id(reference), gpu_type)
                if key not in on_type:
                    on_type[key] = typed_models(reference, [gpu_type])[gpu_type]
                model = on_type[key]
            if batch.dataset_bytes[query] or batch.bytes_per_sample[query]:
                model = model.with_dataset(batch.dataset_bytes[query], batch.bytes_per_sample[query])
            chosen[p] = models.setdefault(model, len(models))
        return chosen[inverse]

    @staticmethod
    def _model_for(i: int, job_id: str, application: str, found: JobRecord | None | Exception, fallbacks: list[str]) -> JobModel:
        field = f"queries[{i}]"
        if job_id:
            if isinstance(found, JobRecord):
                return found.model
            if isinstance(found, MetadataRefused):
                raise translate(found.error, f"metadata {found.method}", {"job_id": f"{field}.job_id"})
            if isinstance(found, Exception):
                if not application:
                    error = Unavailable if isinstance(found, MetadataUnavailable) else FailedPrecondition
                    raise error(f"{found}; give application to predict from its profile", field=f"{field}.job_id")
                fallbacks.append(job_id)
            elif not application:
                raise NotFound(
                    f"no fitted model for job {job_id!r} (never observed); give application to predict from its profile",
                    field=f"{field}.job_id",
                )
        return _application_model(application, f"{field}.application")

    # --- Observe / GetJobModel ----------------------------------------------------------------

    async def Observe(self, request: estimator_pb2.ObserveRequest, context: object) -> estimator_pb2.ObserveResponse:
        job_id = _check_job_id(request.job_id, "job_id", required=True)
        application = _check_application(request.application, "application")
        observations = _read_observations(request.observations)
        # Identifies a retry of a call whose model was updated in memory but not persisted.
        digest = hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
        async with self._store.lock(job_id):
            record = await self._record(job_id, "job_id")
            if record is None:
                if not application:
                    raise InvalidArgument(
                        f"required on the first observation of job {job_id!r} (no model is known for it)", field="application"
                    )
                record = JobRecord(job_id, await asyncio.to_thread(_application_model, application, "application"))
            elif application and application != record.model.application:
                raise InvalidArgument(
                    f"job {job_id!r} is modelled as {record.model.application!r}, got {application!r}", field="application"
                )
            if self._store.pending_digest(job_id) == digest:
                updated = record  # already applied; only writing it to the metadata service failed
            else:
                updated = await asyncio.to_thread(_refit, record, observations)
            try:
                updated = await self._store.save(updated, digest)
            except UnknownJob as exc:
                raise NotFound(f"the metadata service has no job {job_id!r} ({exc})", field="job_id") from None
            except MetadataRefused as exc:
                raise translate(exc.error, f"metadata {exc.method}", {"model.job_id": "job_id"}) from None
            except MetadataUnavailable as exc:
                raise Unavailable(
                    f"{exc}; the model was updated in this estimator's memory only and is persisted by the next "
                    "successful Observe of the job (retrying this same request does not count it twice)"
                ) from None
        return estimator_pb2.ObserveResponse(model=updated.to_proto())

    async def GetJobModel(self, request: common_pb2.GetJobModelRequest, context: object) -> common_pb2.JobModelParams:
        job_id = _check_job_id(request.job_id, "job_id", required=True)
        record = await self._record(job_id, "job_id")
        if record is None:
            where = "in this estimator or the metadata service" if self._store.persistent else "in this estimator"
            raise NotFound(f"no model for job {job_id!r} {where} (it has not been observed)", field="job_id")
        return record.to_proto()

    async def _record(self, job_id: str, field: str) -> JobRecord | None:
        try:
            return await self._store.lookup(job_id)
        except MetadataUnavailable as exc:
            raise Unavailable(str(exc)) from None
        except MetadataRefused as exc:  # the same code and the caller's field, if it was about the job id
            raise translate(exc.error, f"metadata {exc.method}", {"job_id": field}) from None
        except UnusableRecord as exc:
            raise FailedPrecondition(str(exc), field="job_id") from None


# --- Predict answer encoding -----------------------------------------------------------------
#
# Building one Python Prediction message per pair costs ~4 us, more than predicting it. The
# answer is instead written in protobuf wire format with numpy (every Prediction as a record of
# fixed size) and parsed once by the C protobuf runtime, which is ~6x faster for large calls and
# yields an ordinary PredictResponse. The wire format used is plain protobuf: each double as
# tag + 8 little-endian bytes, batch_size as tag + a 5-byte varint (protobuf parsers accept
# varints padded with continuation bits). Tests compare the result field by field with
# estimator.predict.


def _prediction_record_dtype() -> tuple[np.dtype, list[tuple[str, int]]]:
    layout: list[tuple[str, object]] = [("tag", "u1"), ("size", "u1")]
    columns = []
    for descriptor in estimator_pb2.Prediction.DESCRIPTOR.fields:
        layout.append((f"tag_{descriptor.name}", "u1"))
        if descriptor.type == descriptor.TYPE_DOUBLE:
            layout.append((descriptor.name, "<f8"))
            columns.append((descriptor.name, (descriptor.number << 3) | 1))  # wire type 1: 64-bit
        else:
            assert descriptor.name == "batch_size" and descriptor.type == descriptor.TYPE_INT32
            layout.append((descriptor.name, "u1", (5,)))
            columns.append((descriptor.name, descriptor.number << 3))  # wire type 0: varint
    return np.dtype(layout), columns


_RECORD, _RECORD_COLUMNS = _prediction_record_dtype()
_PREDICTIONS_TAG = 0x12  # PredictResult.predictions: field 2, length-delimited
_RESULTS_TAG = _JOB_ID_TAG = 0x0A  # PredictResponse.results and PredictResult.job_id: field 1, length-delimited
assert _RECORD.itemsize - 2 < 128  # the record's length fits in one varint byte


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_results(job_ids: Sequence[str], counts: np.ndarray, predicted: Predictions) -> bytes:
    """Serialized PredictResponse: one PredictResult per query holding its ``counts[i]`` predictions."""
    records = np.empty(len(predicted), dtype=_RECORD)
    records["tag"] = _PREDICTIONS_TAG
    records["size"] = _RECORD.itemsize - 2
    for name, tag in _RECORD_COLUMNS:
        records[f"tag_{name}"] = tag
        if name == "batch_size":
            value = np.clip(predicted.batch_size, 0, 2**31 - 1).astype(np.uint64)
            septets = (value[:, None] >> (np.arange(5, dtype=np.uint64) * np.uint64(7))) & np.uint64(0x7F)
            septets[:, :4] |= np.uint64(0x80)
            records[name] = septets
        else:
            records[name] = getattr(predicted, name)
    raw = memoryview(records.tobytes())
    parts = []
    offset = 0
    for job_id, count in zip(job_ids, counts.tolist()):
        encoded_id = job_id.encode()
        head = (_JOB_ID_TAG.to_bytes(1, "little") + _varint(len(encoded_id)) + encoded_id) if encoded_id else b""
        size = count * _RECORD.itemsize
        parts += [_RESULTS_TAG.to_bytes(1, "little"), _varint(len(head) + size), head, raw[offset:offset + size]]
        offset += size
    return b"".join(parts)


# --- Observe helpers ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Observations:
    gpus: np.ndarray
    nodes: np.ndarray
    batch_size: np.ndarray
    step_time_s: np.ndarray
    sync_time_s: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray
    gpu_types: list[str]  # per observation, as reported ("" = untyped)


def _read_observations(observations: Sequence[estimator_pb2.StepObservation]) -> _Observations:
    if not 1 <= len(observations) <= MAX_OBSERVATIONS:
        raise InvalidArgument(f"must hold 1..{MAX_OBSERVATIONS} observations, got {len(observations)}", field="observations")
    problems = Problems()
    check = problems.check
    for i, o in enumerate(observations):
        field = f"observations[{i}]"
        check(_check_int, o.gpus, f"{field}.gpus", 1, MAX_GPUS)
        check(_check_int, o.nodes, f"{field}.nodes", 1, max(o.gpus, 1), f"gpus ({o.gpus}): every node holds a GPU of the job")
        check(_check_int, o.batch_size, f"{field}.batch_size", max(o.gpus, 1), MAX_BATCH_SIZE)
        step_ok = check(_check_float, o.step_time_s, f"{field}.step_time_s", 0.0, MAX_STEP_TIME_S, low_open=True)
        if step_ok:
            check(_check_float, o.sync_time_s, f"{field}.sync_time_s", 0.0, o.step_time_s,
                  high_name=f"step_time_s ({o.step_time_s:g})")
        check(_check_float, o.cache_hit_ratio, f"{field}.cache_hit_ratio", 0.0, 1.0)
        check(_check_float, o.grad_sqr, f"{field}.grad_sqr", 0.0, MAX_GRAD_STAT)
        check(_check_float, o.grad_var, f"{field}.grad_var", 0.0, MAX_GRAD_STAT)
        if o.gpu_type and gpu_type_problem(o.gpu_type):
            problems.add(f"{field}.gpu_type", gpu_type_problem(o.gpu_type))
    problems.raise_if_any()
    rows = np.array(
        [(o.gpus, o.nodes, o.batch_size, o.step_time_s, o.sync_time_s, o.grad_sqr, o.grad_var) for o in observations],
        dtype=np.float64,
    )
    return _Observations(*rows.T, gpu_types=[o.gpu_type for o in observations])


def _check_type_count(record: JobRecord, obs: _Observations) -> None:
    """At most MAX_GPU_TYPES_PER_JOB types with a model of their own: each takes room in the stored params."""
    known = set(record.type_models)
    for i, gpu_type in enumerate(obs.gpu_types):
        if is_reference(gpu_type) or gpu_type in known:
            continue
        if len(known) >= MAX_GPU_TYPES_PER_JOB:
            raise FailedPrecondition(
                f"job {record.job_id!r} already has models for {len(known)} GPU types ({', '.join(sorted(known))}), "
                f"the most one job keeps besides the reference type; {gpu_type!r} would be one more",
                field=f"observations[{i}].gpu_type")
        known.add(gpu_type)


def _refit(record: JobRecord, obs: _Observations) -> JobRecord:
    """The record with ``obs`` folded in: each run of steps on one GPU type refits the job's
    model there (estimator.per_type); logs extended, the most recent configurations kept."""
    _check_type_count(record, obs)
    typed = record.typed()
    atomic, accum = split_local_batch(obs.batch_size / obs.gpus, record.model.bounds.max_local_bsz)
    keys = list(zip(obs.nodes.astype(int).tolist(), obs.gpus.astype(int).tolist(), atomic.astype(int).tolist(),
                    accum.astype(int).tolist()))
    recent: dict[str, list[tuple[int, int, int, int]]] = {}
    start = 0
    while start < len(obs.gpu_types):  # consecutive steps on one type are one refit
        gpu_type = obs.gpu_types[start]
        end = start + 1
        while end < len(obs.gpu_types) and obs.gpu_types[end] == gpu_type:
            end += 1
        rows = slice(start, end)
        try:
            typed.observe(gpu_type, obs.gpus[rows], obs.nodes[rows], obs.batch_size[rows], obs.step_time_s[rows],
                          obs.sync_time_s[rows], grad_sqr=obs.grad_sqr[rows], grad_var=obs.grad_var[rows])
        except ValueError as exc:
            raise InvalidArgument(f"cannot fit these observations: {exc}", field="observations") from None
        recent.setdefault("" if is_reference(gpu_type) else gpu_type, []).extend(keys[rows])
        start = end
    logs = {"": typed.reference_log, **typed.logs}
    for gpu_type, keys_seen in recent.items():
        mark_recent(logs[gpu_type], dict.fromkeys(keys_seen))
    trim_logs(list(logs.values()), log_budget(typed.reference, typed.models, typed.speeds))
    return JobRecord(record.job_id, typed.reference, typed.reference_log, record.observations + len(obs.gpus),
                     datetime.now(UTC), type_models=typed.models, type_logs=typed.logs, type_speeds=typed.speeds)
