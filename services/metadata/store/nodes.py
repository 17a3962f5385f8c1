"""Nodes: registration, heartbeats and liveness."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from silod.v1 import common_pb2

from services.metadata import convert
from services.metadata.clock import utc_now
from services.metadata.database import Database
from services.metadata.models import Node
from services.metadata.store import gpu_health
from services.metadata.validation.nodes import (
    check_clear_gpu_fault,
    check_gpu_indices,
    check_heartbeat,
    check_list_nodes,
    check_node_name,
    normalized_node_spec,
)
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound


class NodeStore:
    def __init__(self, db: Database, *, liveness_window_s: float) -> None:
        self._db = db
        self._liveness_window_s = liveness_window_s

    def upsert(self, spec: common_pb2.NodeSpec) -> common_pb2.Node:
        """Register a node or replace its spec; registering also counts as a heartbeat."""
        spec = normalized_node_spec(spec)
        try:
            return self._upsert_once(spec)
        except IntegrityError:
            return self._upsert_once(spec)  # lost a race to insert the same name: now update it

    def _upsert_once(self, spec: common_pb2.NodeSpec) -> common_pb2.Node:
        now = utc_now()
        with self._db.write() as session:
            row = session.get(Node, spec.name)
            if row is None:
                row = Node(name=spec.name, registered_at=now, applied_plan_version=0)
                session.add(row)
            row.pool = spec.pool
            row.gpu_type = spec.gpu_type
            row.spec = convert.to_json(spec)
            row.last_heartbeat = now
            session.flush()
            return self._to_proto(row)

    def heartbeat(self, node: str, applied_plan_version: int,
                  gpu_telemetry: Sequence[common_pb2.GpuTelemetry] = (),
                  gpu_faults: Sequence[common_pb2.GpuFault] = ()) -> common_pb2.Node:
        check_heartbeat(node, applied_plan_version, gpu_telemetry, gpu_faults)
        with self._db.write() as session:
            # Conditional UPDATE: a late heartbeat carrying an older version cannot win a race.
            updated = session.execute(
                update(Node)
                .where(Node.name == node, Node.applied_plan_version <= applied_plan_version)
                .values(last_heartbeat=utc_now(), applied_plan_version=applied_plan_version)
                .execution_options(synchronize_session=False)
            )
            query = select(Node).where(Node.name == node).execution_options(populate_existing=True)
            if gpu_telemetry or gpu_faults:
                query = query.with_for_update()  # gpu_health is read, changed and written back
            row = session.scalars(query).one_or_none()
            if row is None:
                raise NotFound(f"no node {node!r}; register it with UpsertNode first", field="node")
            if gpu_telemetry or gpu_faults:
                # Recorded even when the version is refused below: faults must not wait for a plan.
                check_gpu_indices(node, int(row.spec.get("gpus", 0)), gpu_telemetry, gpu_faults)
                row.gpu_health = gpu_health.after_heartbeat(row.gpu_health, gpu_telemetry, gpu_faults, utc_now())
            if updated.rowcount == 1:
                session.flush()
                return self._to_proto(row)
            # Refused, yet proof of life: a restarted agent reports version 0 until it applies the
            # latest plan, and its node must not age out meanwhile (say, while the scheduler is down).
            row.last_heartbeat = utc_now()
            refused = FailedPrecondition(
                f"must not decrease: node {node} already applied plan {row.applied_plan_version}, "
                f"got {applied_plan_version}",
                field="applied_plan_version",
            )
        raise refused

    def clear_gpu_fault(self, node: str, gpu_index: int) -> common_pb2.Node:
        """An operator's word that GPU ``gpu_index`` of ``node`` is fit again (see gpu_health)."""
        check_clear_gpu_fault(node, gpu_index)
        with self._db.write() as session:
            row = session.scalars(select(Node).where(Node.name == node).with_for_update()).one_or_none()
            if row is None:
                raise NotFound(f"no node {node!r}", field="node")
            gpus = int(row.spec.get("gpus", 0))
            if gpu_index >= gpus:
                raise InvalidArgument(f"node {node} has {gpus} GPUs (0..{gpus - 1}), got {gpu_index}"
                                      if gpus else f"node {node} has no GPUs, got {gpu_index}", field="gpu_index")
            cleared = gpu_health.after_clear(row.gpu_health, gpu_index)
            if cleared is None:
                raise FailedPrecondition(f"GPU {gpu_index} of node {node} has no fault to clear", field="gpu_index")
            row.gpu_health = cleared
            session.flush()
            return self._to_proto(row)

    def get(self, node: str) -> common_pb2.Node:
        check_node_name(node)
        with self._db.read() as session:
            row = session.get(Node, node)
            if row is None:
                raise NotFound(f"no node {node!r}", field="node")
            return self._to_proto(row)

    def list(self, *, pool: int = 0, alive_only: bool = False, liveness_window_s: float = 0.0,
             gpu_type: str = "") -> list[common_pb2.Node]:
        check_list_nodes(pool, liveness_window_s, gpu_type)
        window = liveness_window_s or self._liveness_window_s
        now = utc_now()
        query = select(Node).order_by(Node.name)
        if pool:
            query = query.where(Node.pool == pool)
        if gpu_type:
            query = query.where(Node.gpu_type == gpu_type)
        if alive_only:
            query = query.where(Node.last_heartbeat >= now - timedelta(seconds=window))
        with self._db.read() as session:
            return [self._to_proto(row, now=now, window=window) for row in session.scalars(query)]

    def _to_proto(self, row: Node, *, now: datetime | None = None, window: float | None = None) -> common_pb2.Node:
        return convert.node_to_proto(
            row,
            now=now or utc_now(),
            liveness_window_s=self._liveness_window_s if window is None else window,
        )
