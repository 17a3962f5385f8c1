"""Rows to protobuf messages and protobuf messages to JSON columns."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from silod.v1 import common_pb2, plan_pb2

from services.metadata import models
from services.metadata.clock import as_utc, to_timestamp

M = TypeVar("M", bound=Message)
T = TypeVar("T")


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
    job = job_state_to_proto(row)
    job.spec.CopyFrom(spec(row.id, row.spec))
    job.progress.CopyFrom(progress(row.id, row.progress))
    job.allocated.CopyFrom(allocated(row.id, row.allocated))
    return job


def job_state_to_proto(row: Any) -> common_pb2.Job:
    """The Job of ``row`` without spec, progress and allocated: its state and time stamps
    (TransitionJobsRequest.state_only)."""
    return common_pb2.Job(
        id=row.id,
        state=row.state,
        client_request_id=row.client_request_id or "",
        state_version=row.state_version,
        created_at=to_timestamp(row.created_at),
        updated_at=to_timestamp(row.updated_at),
        started_at=to_timestamp(row.started_at),
        finished_at=to_timestamp(row.finished_at),
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


_NODE_SPECS = _ParseMemo(common_pb2.NodeSpec)


class _TextMemo(Generic[T]):
    """Remembers what was built from a row's JSON column, per row, keyed on the column's text:
    a hit costs one string comparison, no JSON decode and no parse. Values are shared: callers
    copy the messages in them (a message-typed constructor argument does)."""

    def __init__(self, build: Callable[[str], T], max_entries: int = 50_000) -> None:
        self._build = build
        self._max = max_entries
        self._entries: dict[str, tuple[str, T]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, text: str) -> T:
        hit = self._entries.get(key)
        if hit is not None and hit[0] == text:
            return hit[1]
        value = self._build(text)
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()
            self._entries[key] = (text, value)
        return value


_GpuHealth = tuple[tuple[common_pb2.GpuTelemetry, ...], tuple[common_pb2.GpuFault, ...]]
_NO_GPU_HEALTH: _GpuHealth = ((), ())


def _gpu_health(health: dict[str, Any] | None) -> _GpuHealth:
    """The figures and the faults (by GPU index) of a node's gpu_health JSON, fresh messages."""
    if not health:
        return _NO_GPU_HEALTH
    return (tuple(from_json(g, common_pb2.GpuTelemetry) for g in health.get("telemetry", [])),
            tuple(from_json(f, common_pb2.GpuFault)
                  for _, f in sorted(health.get("faults", {}).items(), key=lambda kv: int(kv[0]))))


def _node_spec_of_text(text: str) -> common_pb2.NodeSpec:
    return from_json(json.loads(text), common_pb2.NodeSpec) if text else common_pb2.NodeSpec()


_NODE_SPEC_TEXTS: _TextMemo[common_pb2.NodeSpec] = _TextMemo(_node_spec_of_text)
_NODE_GPU_HEALTH_TEXTS: _TextMemo[_GpuHealth] = _TextMemo(lambda text: _gpu_health(json.loads(text)))
_EMPTY_JSON_TEXTS = frozenset(("", "null", "{}"))


def _node_message(spec: common_pb2.NodeSpec, registered_at: datetime, last_heartbeat: datetime, alive: bool,
                  applied_plan_version: int, health: _GpuHealth) -> common_pb2.Node:
    # The constructor copies spec and the GPU messages: the memos' shared messages stay unexposed.
    telemetry, faults = health
    if telemetry or faults:
        return common_pb2.Node(spec=spec, registered_at=to_timestamp(registered_at),
                               last_heartbeat=to_timestamp(last_heartbeat), alive=alive,
                               applied_plan_version=applied_plan_version, gpu_telemetry=telemetry,
                               gpu_faults=faults)
    return common_pb2.Node(spec=spec, registered_at=to_timestamp(registered_at),
                           last_heartbeat=to_timestamp(last_heartbeat), alive=alive,
                           applied_plan_version=applied_plan_version)


def node_to_proto(row: models.Node, *, now: datetime, liveness_window_s: float) -> common_pb2.Node:
    """The Node message of an ORM row (JSON columns decoded)."""
    return _node_message(
        _NODE_SPECS.parse(row.name, row.spec), row.registered_at, row.last_heartbeat,
        as_utc(row.last_heartbeat) >= now - timedelta(seconds=liveness_window_s), row.applied_plan_version,
        _gpu_health(row.gpu_health),
    )


class _NodeRows:
    """The Node message of each node's last read row, reused while the row is unchanged.

    The scheduler lists every node every second and each node heartbeats every few seconds, so
    most rows of a listing are as the last read (often the node's own heartbeat) left them. The
    key is the whole row as read, so a change to any column is a miss. The message is kept
    without ``alive``, which depends on the time of the read; it is shared and never handed
    out: callers get copies.
    """

    def __init__(self, max_entries: int = 50_000) -> None:
        self._max = max_entries
        self._entries: dict[str, tuple[tuple[Any, ...], common_pb2.Node, datetime]] = {}
        self._lock = threading.Lock()

    def get(self, row: Any, to_datetime: Callable[[Any], datetime]) -> tuple[common_pb2.Node, datetime]:
        key = tuple(row)
        name = key[0]
        hit = self._entries.get(name)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        _, spec_text, registered_at, last_heartbeat, applied_plan_version, health_text = key
        last_heartbeat = to_datetime(last_heartbeat)
        health = (_NO_GPU_HEALTH if health_text is None or health_text in _EMPTY_JSON_TEXTS
                  else _NODE_GPU_HEALTH_TEXTS.get(name, health_text))
        node = _node_message(_NODE_SPEC_TEXTS.get(name, spec_text), to_datetime(registered_at), last_heartbeat,
                             False, applied_plan_version, health)
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries.clear()  # crude but bounded; a later listing refills it
            self._entries[name] = (key, node, last_heartbeat)
        return node, last_heartbeat


_NODE_ROWS = _NodeRows()


def node_row_to_proto(row: Any, *, alive_since: datetime, to_datetime: Callable[[Any], datetime]) -> common_pb2.Node:
    """The Node message of a Core row (NodeStore's reads and heartbeats): name, spec and
    gpu_health as their JSON text, registered_at, last_heartbeat (as the driver returns them;
    ``to_datetime`` makes aware UTC datetimes of them), applied_plan_version. An unchanged row
    costs a copy of the message built when it was first seen; unchanged JSON is never decoded
    or parsed again. ``alive_since``: the oldest heartbeat that counts as alive."""
    shared, last_heartbeat = _NODE_ROWS.get(row, to_datetime)
    node = common_pb2.Node()
    node.CopyFrom(shared)
    node.alive = last_heartbeat >= alive_since
    return node


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
