"""Where the estimator keeps fitted job models: in memory, persisted through the metadata service.

A :class:`JobRecord` is everything the estimator knows about one job: its :class:`JobModel`
(the fitted parameters predictions use), the :class:`ObservationLog` later refits start from
and how many observations went in. It round-trips through ``silod.v1.JobModelParams``: the
model's and the log's flat ``params`` side by side, so a restarted estimator resumes where it
stopped.

:class:`ModelStore` holds the records of this process. With a metadata stub attached every
change is written through with ``PutJobModel`` and jobs missing from memory are read with
``GetJobModel``; without one the records live in memory only and die with the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from estimator.fitting import ObservationLog
from estimator.gpu_types import typed_models
from estimator.job_model import PERF_KEYS, JobModel
from estimator.per_type import TypedModels, is_reference, types_from_params, types_to_params
from services.runtime.structured_logging import get_logger
from silod.v1 import common_pb2, metadata_pb2

_log = get_logger("silod.estimator")

# The metadata store accepts at most 256 params per job. The model takes 16, each GPU type with
# a model of its own 8 (its perf params and speed), each log entry (one configuration the job
# ran in, on any type) 7: the logs together keep the 32 most recently observed configurations,
# fewer once types take room (16 + 32 * 7 = 240; with 8 types 25 entries, see log_budget).
MAX_PARAMS = 256
MAX_LOG_ENTRIES = 32
LOG_ENTRY_PARAMS = len(ObservationLog._FIELDS)
MAX_GPU_TYPES_PER_JOB = 8  # GPU types besides the reference one a job keeps a model for
# Seconds a "no model stored for this job" answer of the metadata service is trusted by Predict
# before it asks again (this process writes models itself, so the answer only goes stale when
# another estimator fits the same job).
ABSENT_TTL_S = 30.0
# Seconds Predict stops asking an unreachable metadata service (each attempt costs the channel's
# retries) and falls back to profiles straight away.
DOWN_BACKOFF_S = 5.0

# Metadata answers that mean "the metadata service cannot be used right now", as opposed to a
# bug on either side.
_UNUSABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


class MetadataUnavailable(Exception):
    """The metadata service could not be reached or refused us; the message says which and why."""


class MetadataRefused(Exception):
    """The metadata service refused a call (INVALID_ARGUMENT, NOT_FOUND, INTERNAL, ...): the
    servicer answers it by the shared rule (services/runtime/downstream.py), which names the
    caller's field when the refusal was about it."""

    def __init__(self, method: str, error: grpc.RpcError) -> None:
        super().__init__(f"metadata {method} answered {error.code().name}: {error.details()}")
        self.method = method
        self.error = error


class UnknownJob(Exception):
    """The metadata service has no such job (PutJobModel answered NOT_FOUND)."""


class UnusableRecord(Exception):
    """A stored JobModelParams cannot be turned back into a model (missing or out-of-range params)."""


@dataclass(frozen=True)
class JobRecord:
    """What the estimator knows about one job. Never mutated: changes make a new record."""

    job_id: str
    model: JobModel  # on the reference type (estimator.gpu_types.REFERENCE_TYPE) or untyped nodes
    log: ObservationLog = field(default_factory=ObservationLog)  # treat as read-only; copy to change
    observations: int = 0  # StepObservations folded in over the job's life
    updated_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    # The flat JobModelParams.params of model and log. Computed when left empty; a record read
    # from the metadata service keeps the stored values exactly (the log's running means do not
    # survive a round trip bit for bit), so what GetJobModel returns never drifts.
    params: dict[str, float] = field(default_factory=dict)
    # Other GPU types the job was observed on (estimator.per_type): model, log, bootstrapped speed.
    type_models: dict[str, JobModel] = field(default_factory=dict)
    type_logs: dict[str, ObservationLog] = field(default_factory=dict)
    type_speeds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.params:
            typed = types_to_params(self.type_models, self.type_logs, self.type_speeds)
            object.__setattr__(self, "params", {**self.model.to_params(), **self.log.to_params(), **typed})

    def model_on(self, gpu_type: str) -> JobModel:
        """The job's model on ``gpu_type``: fitted there if observed there, else the reference
        model scaled by the application's measured speed (1 for a type the table lacks)."""
        if is_reference(gpu_type):
            return self.model
        fitted = self.type_models.get(gpu_type)
        return fitted if fitted is not None else typed_models(self.model, [gpu_type])[gpu_type]

    def typed(self) -> TypedModels:
        """A mutable copy of the per-type state to fold observations into."""
        return TypedModels(self.model, copy_log(self.log), {t: copy_log(log) for t, log in self.type_logs.items()},
                           dict(self.type_models), dict(self.type_speeds))

    def to_proto(self) -> common_pb2.JobModelParams:
        stamp = Timestamp()
        stamp.FromDatetime(self.updated_at)
        return common_pb2.JobModelParams(
            job_id=self.job_id,
            application=self.model.application,
            params=self.params,
            observations=self.observations,
            updated_at=stamp,
        )

    @classmethod
    def from_proto(cls, proto: common_pb2.JobModelParams) -> JobRecord:
        """Inverse of :meth:`to_proto`; :class:`UnusableRecord` if the params make no model."""
        params = dict(proto.params)
        try:
            model = JobModel.from_params(proto.application, params)
            log = ObservationLog.from_params(params)
            models, logs, speeds = types_from_params(model, params)
        except (ValueError, KeyError, IndexError) as exc:
            raise UnusableRecord(f"stored model of job {proto.job_id!r} cannot be read: {exc}") from exc
        updated = proto.updated_at.ToDatetime(tzinfo=UTC) if proto.HasField("updated_at") else datetime.now(UTC)
        return cls(proto.job_id, model, log, int(proto.observations), updated, params, models, logs, speeds)


def copy_log(log: ObservationLog) -> ObservationLog:
    return ObservationLog(entries={key: list(value) for key, value in log.entries.items()})


def trim_log(log: ObservationLog, recent: Iterable[tuple[int, int, int, int]]) -> None:
    """Move the ``recent`` configurations to the end of ``log`` (mutated), then keep the last MAX_LOG_ENTRIES."""
    mark_recent(log, recent)
    trim_logs([log], MAX_LOG_ENTRIES)


def mark_recent(log: ObservationLog, recent: Iterable[tuple[int, int, int, int]]) -> None:
    """Move the ``recent`` configurations to the end of ``log`` (mutated): the last to be trimmed."""
    for key in recent:
        if key in log.entries:
            log.entries[key] = log.entries.pop(key)


def log_budget(model: JobModel, type_models: dict[str, JobModel], type_speeds: dict[str, float]) -> int:
    """Log entries (over all types) that fit in MAX_PARAMS beside the models, at most MAX_LOG_ENTRIES."""
    fixed = len(model.to_params()) + len(type_models) * len(PERF_KEYS) + len(type_speeds)
    return max(0, min(MAX_LOG_ENTRIES, (MAX_PARAMS - fixed) // LOG_ENTRY_PARAMS))


def trim_logs(logs: list[ObservationLog], budget: int) -> None:
    """Drop the oldest entry of the longest log (mutated) until all hold ``budget`` entries together,
    so a type observed briefly keeps its few entries while a long-running one gives up old ones."""
    while sum(len(log) for log in logs) > budget:
        longest = max(logs, key=len)
        del longest.entries[next(iter(longest.entries))]


class ModelStore:
    """Job records of this process; written through to the metadata service when it has a stub."""

    def __init__(self, metadata_address: str = "") -> None:
        self.metadata_address = metadata_address
        self._stub = None  # MetadataServiceStub, attached once the event loop runs
        self._records: dict[str, JobRecord] = {}
        self._absent: dict[str, float] = {}  # job id -> monotonic time metadata said "no model"
        self._dirty: dict[str, bytes] = {}  # job id -> digest of the Observe applied but not persisted
        self._locks: dict[str, asyncio.Lock] = {}
        self._down_until = 0.0

    def attach(self, stub: object) -> None:
        self._stub = stub

    @property
    def persistent(self) -> bool:
        return self._stub is not None

    def lock(self, job_id: str) -> asyncio.Lock:
        """Serializes the read-refit-write of one job's Observe calls."""
        lock = self._locks.get(job_id)
        if lock is None:
            lock = self._locks[job_id] = asyncio.Lock()
        return lock

    def cached(self, job_id: str) -> JobRecord | None:
        return self._records.get(job_id)

    def pending_digest(self, job_id: str) -> bytes | None:
        """Digest of the Observe request applied in memory whose write to metadata failed."""
        return self._dirty.get(job_id)

    async def lookup(self, job_id: str, *, for_predict: bool = False) -> JobRecord | None:
        """The job's record from memory, else from the metadata service; None if neither has one.

        ``for_predict`` trusts a recent "no model" answer (:data:`ABSENT_TTL_S`) and gives up at
        once while the metadata service is known to be down, so a scheduling round does not wait
        for it. Raises :class:`MetadataUnavailable`, :class:`MetadataRefused` and :class:`UnusableRecord`.
        """
        record = self._records.get(job_id)
        if record is not None or self._stub is None:
            return record
        now = time.monotonic()
        if for_predict:
            seen = self._absent.get(job_id)
            if seen is not None and now - seen < ABSENT_TTL_S:
                return None
            if now < self._down_until:
                raise MetadataUnavailable(f"metadata service at {self.metadata_address} was unreachable moments ago")
        try:
            proto = await self._stub.GetJobModel(common_pb2.GetJobModelRequest(job_id=job_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                self._absent[job_id] = time.monotonic()
                return None
            raise self._failure("GetJobModel", exc) from None
        self._down_until = 0.0
        self._absent.pop(job_id, None)
        loaded = JobRecord.from_proto(proto)
        # An Observe may have stored a newer record while we waited for the answer.
        return self._records.setdefault(job_id, loaded)

    async def save(self, record: JobRecord, digest: bytes = b"") -> JobRecord:
        """Keep ``record`` and write it to the metadata service; returns it as kept (with the
        metadata service's ``updated_at`` once persisted).

        Raises :class:`UnknownJob` (record not kept) when metadata has no such job, and
        :class:`MetadataUnavailable` (record kept in memory, marked dirty with ``digest``) when
        it cannot be written now; the next successful save or :meth:`flush` persists it.
        """
        if self._stub is None:
            self._records[record.job_id] = record
            return record
        try:
            stored = await self._stub.PutJobModel(metadata_pb2.PutJobModelRequest(model=record.to_proto()))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise UnknownJob(exc.details() or "no such job") from None
            failure = self._failure("PutJobModel", exc)
            self._records[record.job_id] = record
            self._dirty[record.job_id] = digest
            raise failure from None
        self._down_until = 0.0
        if stored.HasField("updated_at"):
            record = dataclasses.replace(record, updated_at=stored.updated_at.ToDatetime(tzinfo=UTC))
        self._records[record.job_id] = record
        self._absent.pop(record.job_id, None)
        self._dirty.pop(record.job_id, None)
        return record

    async def flush(self) -> None:
        """Try once more to persist records whose write failed (called at shutdown)."""
        for job_id in list(self._dirty):
            record = self._records.get(job_id)
            if record is None:
                continue
            try:
                await self.save(record, self._dirty[job_id])
            except Exception as exc:  # shutting down: report, never raise
                _log.warning("job model not persisted", extra={"job_id": job_id, "error": str(exc)})

    def _failure(self, method: str, exc: grpc.aio.AioRpcError) -> Exception:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._down_until = time.monotonic() + DOWN_BACKOFF_S
        if exc.code() in _UNUSABLE:
            return MetadataUnavailable(
                f"metadata service at {self.metadata_address} failed {method}: {exc.code().name}: {exc.details()}"
            )
        # INVALID_ARGUMENT and the like: not a condition the caller can wait out.
        return MetadataRefused(method, exc)
