"""Rows to protobuf messages and protobuf messages to JSON columns."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from silod.v1 import common_pb2, plan_pb2

from services.metadata import models
from services.metadata.clock import as_utc, to_timestamp

M = TypeVar("M", bound=Message)


def to_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def from_json(data: dict[str, Any], message_type: type[M]) -> M:
    # Rows written by a newer silod may carry fields this version does not know; keep going.
    return json_format.ParseDict(data, message_type(), ignore_unknown_fields=True)


class _ParseMemo(Generic[M]):
    """Remembers the message parsed from a row's JSON column, per row.

    json_format parses in pure Python, tens of microseconds a message: listing 1,000 jobs would
    spend most of its time re-parsing specs that never change. A hit costs one dict comparison;
    a changed value (progress moves on) is simply parsed again. Callers must copy the returned
    message (a message-typed constructor argument does), since it is shared.
    """

    def __init__(self, message_type: type[M], max_entries: int = 50_000) -> None:
        self._type = message_type
        self._max = max_entries
        self._entries: dict[str, tuple[dict[str, Any], M]] = {}
        self._lock = threading.Lock()  # store calls run in several worker threads

    def parse(self, key: str, data: dict[str, Any]) -> M:
        if not data:
            return self._type()
        hit = self._entries.get(key)
        if hit is not None and hit[0] == data:
            return hit[1]
        message = from_json(data, self._type)
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()  # crude but bounded; a later listing refills it
            self._entries[key] = (data, message)
        return message

    def parse_text(self, key: str, text: str) -> M:
        """As :meth:`parse`, from the column's JSON text: a hit costs one JSON decode, not a parse."""
        if not text or text == "{}":
            return self._type()
        return self.parse(key, json.loads(text))

    def remember(self, key: str, data: dict[str, Any], message: M) -> None:
        """Seed the memo with a message and the JSON it was stored as (a row just written)."""
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()
            self._entries[key] = (data, message)


_JOB_SPECS = _ParseMemo(common_pb2.JobSpec)
_JOB_PROGRESS = _ParseMemo(common_pb2.JobProgress)
_JOB_ALLOCATED = _ParseMemo(common_pb2.ResourceVector)


def job_to_proto(row: models.Job | Any) -> common_pb2.Job:
    return _job_message(row, columns_as_text=False)


def _job_message(row: models.Job | Any, *, columns_as_text: bool) -> common_pb2.Job:
    """The Job message of ``row``, whose JSON columns are decoded values (an ORM row) or, with
    ``columns_as_text``, the columns' text (a Core row)."""
    memos = (_JOB_SPECS, _JOB_PROGRESS, _JOB_ALLOCATED)
    spec, progress, allocated = (m.parse_text if columns_as_text else m.parse for m in memos)
    return common_pb2.Job(
        id=row.id,
        spec=spec(row.id, row.spec),
        state=row.state,  # type: ignore[arg-type]
        client_request_id=row.client_request_id or "",
        state_version=row.state_version,
        created_at=to_timestamp(row.created_at),
        updated_at=to_timestamp(row.updated_at),
        started_at=to_timestamp(row.started_at),
        finished_at=to_timestamp(row.finished_at),
        progress=progress(row.id, row.progress),
        allocated=allocated(row.id, row.allocated),
        message=row.message,
    )


class _JobMemo:
    """The Job message of each job's last listed row, reused while the row is unchanged.

    A scheduler lists every active job each round, most of them unchanged since the last one;
    building 1,000 Job messages (JSON decoding, nested messages, timestamps) was most of the
    listing's cost. The key is the whole row as read (JSON columns as their text), so any
    change to any column is a miss. Returned messages are shared: callers copy them.
    """

    def __init__(self, max_entries: int = 50_000) -> None:
        self._max = max_entries
        self._entries: dict[str, tuple[tuple[Any, ...], common_pb2.Job]] = {}
        self._lock = threading.Lock()

    def get(self, row: Any) -> common_pb2.Job:
        key = tuple(row)
        hit = self._entries.get(row.id)
        if hit is not None and hit[0] == key:
            return hit[1]
        job = _job_message(row, columns_as_text=True)
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()
            self._entries[row.id] = (key, job)
        return job


_LISTED_JOBS = _JobMemo()


def listed_job_to_proto(row: Any) -> common_pb2.Job:
    """job_to_proto for a row whose JSON columns were read as text (JobStore.list)."""
    job = common_pb2.Job()
    job.CopyFrom(_LISTED_JOBS.get(row))
    return job


def new_job_proto(job_id: str, spec: common_pb2.JobSpec, spec_json: dict[str, Any], client_request_id: str,
                  now: datetime) -> common_pb2.Job:
    """The Job a fresh PENDING row (as JobStore inserts it) reads back as, built without reading
    it back; ``spec`` (stored as ``spec_json``) is remembered for the listings to come."""
    _JOB_SPECS.remember(job_id, spec_json, spec)
    stamp = to_timestamp(now)
    return common_pb2.Job(id=job_id, spec=spec, state=common_pb2.JOB_STATE_PENDING, client_request_id=client_request_id,
                          state_version=1, created_at=stamp, updated_at=stamp, progress=common_pb2.JobProgress(),
                          allocated=common_pb2.ResourceVector())


def event_to_proto(row: models.JobEvent) -> common_pb2.JobEvent:
    return common_pb2.JobEvent(
        job_id=row.job_id,
        sequence=row.sequence,
        time=to_timestamp(row.time),
        type=row.type,
        from_state=row.from_state,  # type: ignore[arg-type]
        to_state=row.to_state,  # type: ignore[arg-type]
        message=row.message,
    )


def dataset_to_proto(row: models.Dataset) -> common_pb2.Dataset:
    return common_pb2.Dataset(
        spec=common_pb2.DatasetSpec(
            name=row.name, uri=row.uri, storage_options=row.storage_options, description=row.description,
            tenant=row.tenant, shared=row.shared,
        ),
        num_objects=row.num_objects,
        total_bytes=row.total_bytes,
        manifest_version=row.manifest_version,
        registered_at=to_timestamp(row.registered_at),
        updated_at=to_timestamp(row.updated_at),
    )


def node_to_proto(row: models.Node, *, now: datetime, liveness_window_s: float) -> common_pb2.Node:
    return common_pb2.Node(
        spec=from_json(row.spec, common_pb2.NodeSpec),
        registered_at=to_timestamp(row.registered_at),
        last_heartbeat=to_timestamp(row.last_heartbeat),
        alive=as_utc(row.last_heartbeat) >= now - timedelta(seconds=liveness_window_s),
        applied_plan_version=row.applied_plan_version,
        gpu_telemetry=[from_json(g, common_pb2.GpuTelemetry) for g in (row.gpu_health or {}).get("telemetry", [])],
        gpu_faults=[from_json(f, common_pb2.GpuFault)
                    for _, f in sorted((row.gpu_health or {}).get("faults", {}).items(), key=lambda kv: int(kv[0]))],
    )


def plan_to_proto(row: models.Plan) -> plan_pb2.AllocationPlan:
    return from_json(row.plan, plan_pb2.AllocationPlan)


def sample_to_proto(row: models.MetricSample) -> common_pb2.MetricSample:
    return common_pb2.MetricSample(
        job_id=row.job_id, time=to_timestamp(row.time), name=row.name, value=row.value, labels=row.labels
    )


def job_model_to_proto(row: models.JobModel) -> common_pb2.JobModelParams:
    return common_pb2.JobModelParams(
        job_id=row.job_id,
        application=row.application,
        params=row.params,
        observations=row.observations,
        updated_at=to_timestamp(row.updated_at),
    )
