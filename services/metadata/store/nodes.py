"""Nodes: registration, heartbeats and liveness."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Dialect, Insert, Select, Text, bindparam, cast, column, func, select, type_coerce, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType
from silod.v1 import common_pb2

from services.metadata import convert
from services.metadata.clock import as_utc, utc_now
from services.metadata.database import Database
from services.metadata.models import ChangeCount, Node
from services.metadata.store import gpu_health
from services.metadata.validation.nodes import (
    check_clear_gpu_fault,
    check_gpu_indices,
    check_heartbeat,
    check_list_nodes,
    check_node_changes,
    check_node_name,
    normalized_node_spec,
)
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError


_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeListing:
    """A ListNodes answer (see ListNodesResponse)."""

    nodes: list[common_pb2.Node]
    cursor: int  # the change count the answer is as of: the next listing's changed_after
    not_alive: list[str]  # with changed_after: every node not alive now, by name
    whole: bool  # nodes is the whole listing, not changes


class NodeStore:
    def __init__(self, db: Database, *, liveness_window_s: float) -> None:
        self._db = db
        self._liveness_window_s = liveness_window_s
        self._window = timedelta(seconds=liveness_window_s)
        self._to_datetime = _datetime_reader(db.engine.dialect)
        self._register = _register_statement(db.engine.dialect.name)
        # A batch of heartbeats as one statement: PostgreSQL, where each statement is a round trip
        # (SQLite's cost none, and it has no arrays). benchmarks/metadata_node_writes.py turns it
        # off to measure both ways side by side.
        self.grouped_heartbeats = db.dialect == "postgresql"

    def upsert(self, spec: common_pb2.NodeSpec) -> common_pb2.Node:
        """Register a node or replace its spec; registering also counts as a heartbeat."""
        spec = normalized_node_spec(spec)
        # Prebuilt Core statements, as heartbeats: 5,000 nodes joining at once each register.
        # INSERT ... ON CONFLICT settles a race to register one name in the database.
        with self._db.write_core() as connection:
            connection.execute(self._register, self._register_values(spec, utc_now()))
            # Every registration is a change, the same spec again too: an agent that registers
            # again may have come back on another host (its address is part of the spec). The
            # node's row first, then the count, in every path (no two writers wait on each other).
            seq = _bump_nodes(connection)
            row = connection.execute(_SET_CHANGED, {"c_name": spec.name, "c_seq": seq}).one()
        return self._row_to_proto(row)

    @staticmethod
    def _register_values(spec: common_pb2.NodeSpec, now: datetime) -> dict[str, Any]:
        return {"u_name": spec.name, "u_pool": spec.pool, "u_gpu_type": spec.gpu_type, "u_spec": convert.to_json(spec),
                "u_now": now}

    def upsert_many(self, specs: Sequence[common_pb2.NodeSpec]) -> list[common_pb2.Node | ServiceError]:
        """Each spec as :meth:`upsert` would store it, in one transaction: the nodes of a fleet
        that start together register together, one commit and one change count taken for the lot
        rather than one each (a registration held the count's row through its own commit, so on
        PostgreSQL registrations went one commit at a time). Results in order: the node, or the
        error of that spec alone. A database error leaves every spec to :meth:`upsert`."""
        results: list[common_pb2.Node | ServiceError | None] = [None] * len(specs)
        todo: list[tuple[int, common_pb2.NodeSpec]] = []
        for index, spec in enumerate(specs):
            try:
                todo.append((index, normalized_node_spec(spec)))
            except ServiceError as exc:
                results[index] = exc
        # Each node's first spec: the rows in name order, then the count, as upsert takes them (so
        # that no two writers wait on each other). A node's later specs after, each as upsert.
        first: dict[str, tuple[int, common_pb2.NodeSpec]] = {}
        again: list[tuple[int, common_pb2.NodeSpec]] = []
        for index, spec in todo:
            if spec.name in first:
                again.append((index, spec))
            else:
                first[spec.name] = (index, spec)
        grouped = [first[name] for name in sorted(first)]
        try:
            with self._db.write_core() as connection:
                now = utc_now()
                for _, spec in grouped:
                    connection.execute(self._register, self._register_values(spec, now))
                last = _bump_nodes(connection, len(grouped)) if grouped else 0
                for offset, (index, spec) in enumerate(grouped):
                    results[index] = connection.execute(_SET_CHANGED, {"c_name": spec.name,
                                                                       "c_seq": last - len(grouped) + 1 + offset}).one()
                for index, spec in again:
                    connection.execute(self._register, self._register_values(spec, now))
                    results[index] = connection.execute(_SET_CHANGED, {"c_name": spec.name,
                                                                       "c_seq": _bump_nodes(connection)}).one()
        except SQLAlchemyError:
            _log.warning("batched registrations failed; storing each on its own", exc_info=True)
            for index, spec in todo:
                try:
                    results[index] = self.upsert(spec)
                except ServiceError as exc:
                    results[index] = exc
            return results  # type: ignore[return-value]  # every index was filled
        return [r if isinstance(r, ServiceError) else self._row_to_proto(r) for r in results]  # type: ignore[misc]

    def heartbeat(self, node: str, applied_plan_version: int,
                  gpu_telemetry: Sequence[common_pb2.GpuTelemetry] = (),
                  gpu_faults: Sequence[common_pb2.GpuFault] = ()) -> common_pb2.Node:
        check_heartbeat(node, applied_plan_version, gpu_telemetry, gpu_faults)
        if gpu_telemetry or gpu_faults:
            return self._heartbeat_with_gpu_health(node, applied_plan_version, gpu_telemetry, gpu_faults)
        # Every node's every heartbeat, and the scheduler's forwarded plan acks: prebuilt Core
        # statements, as JobStore.transition does. UPDATE ... RETURNING is the conditional write
        # (a late heartbeat carrying an older version cannot win a race) and the read at once.
        with self._db.write_core() as connection:
            row = connection.execute(_HEARTBEAT, {"h_name": node, "h_version": applied_plan_version,
                                                  "h_now": utc_now()}).one_or_none()
            if row is not None:
                return self._row_to_proto(row)
            # Refused, yet proof of life: a restarted agent reports version 0 until it applies the
            # latest plan, and its node must not age out meanwhile (say, while the scheduler is down).
            stored = connection.execute(_PROOF_OF_LIFE, {"h_name": node, "h_now": utc_now()}).one_or_none()
            if stored is None:
                raise NotFound(f"no node {node!r}; register it with UpsertNode first", field="node")
            refused = _refused(node, stored.applied_plan_version, applied_plan_version)
        raise refused  # after the block, which commits the proof of life

    def heartbeat_many(self, beats: Sequence[tuple[str, int]]) -> list[common_pb2.Node | ServiceError]:
        """Each (node, applied_plan_version) as :meth:`heartbeat` without GPU figures would store
        it, in one transaction: a thousand nodes' heartbeats that arrive together pay one commit
        and no savepoint each. Results in order: the node, or the error of that heartbeat alone
        (its proof of life is still stored, as heartbeat stores it). A database error leaves
        every heartbeat to :meth:`heartbeat`, one transaction each."""
        results: list[common_pb2.Node | ServiceError | None] = [None] * len(beats)
        todo: list[int] = []
        for index, (node, version) in enumerate(beats):
            try:
                check_heartbeat(node, version, (), ())
                todo.append(index)
            except ServiceError as exc:
                results[index] = exc
        try:
            with self._db.write_core() as connection:
                now = utc_now()
                singles = todo
                if self.grouped_heartbeats:
                    singles = _heartbeats_grouped(connection, beats, todo, results, now)
                for index in singles:
                    node, version = beats[index]
                    row = connection.execute(_HEARTBEAT, {"h_name": node, "h_version": version,
                                                          "h_now": now}).one_or_none()
                    if row is not None:
                        results[index] = row
                        continue
                    stored = connection.execute(_PROOF_OF_LIFE, {"h_name": node, "h_now": now}).one_or_none()
                    results[index] = (NotFound(f"no node {node!r}; register it with UpsertNode first", field="node")
                                      if stored is None else _refused(node, stored.applied_plan_version, version))
        except SQLAlchemyError:
            _log.warning("batched heartbeats failed; storing each on its own", exc_info=True)
            for index in todo:
                try:
                    results[index] = self.heartbeat(*beats[index])
                except ServiceError as exc:
                    results[index] = exc
            return results  # type: ignore[return-value]  # every index was filled
        # Rows to messages after the commit, outside the write lock the other writers wait for.
        return [r if isinstance(r, ServiceError) else self._row_to_proto(r) for r in results]  # type: ignore[misc]

    def _heartbeat_with_gpu_health(self, node: str, applied_plan_version: int,
                                   gpu_telemetry: Sequence[common_pb2.GpuTelemetry],
                                   gpu_faults: Sequence[common_pb2.GpuFault]) -> common_pb2.Node:
        with self._db.write() as session:
            # Conditional UPDATE: a late heartbeat carrying an older version cannot win a race.
            updated = session.execute(_ORM_HEARTBEAT, {"h_name": node, "h_version": applied_plan_version,
                                                       "h_now": utc_now()})
            # Locked: gpu_health is read, changed and written back.
            row = session.scalars(_ORM_LOCKED_NODE, {"h_name": node}).one_or_none()
            if row is None:
                raise NotFound(f"no node {node!r}; register it with UpsertNode first", field="node")
            # Recorded even when the version is refused below: faults must not wait for a plan.
            check_gpu_indices(node, int(row.spec.get("gpus", 0)), gpu_telemetry, gpu_faults)
            before = row.gpu_health
            row.gpu_health = gpu_health.after_heartbeat(before, gpu_telemetry, gpu_faults, utc_now())
            if gpu_health.faults_changed(before, row.gpu_health):  # not by the figures, which change every beat
                row.changed_seq = _bump_nodes(session)
            if updated.rowcount == 1:
                session.flush()
                # Read back as ListNodes reads it, so that the message built here (parsing the
                # figures is most of its cost) is the one the next listing reuses.
                return self._row_to_proto(session.connection().execute(_GET, {"g_name": node}).one())
            row.last_heartbeat = utc_now()  # refused, yet proof of life (as in heartbeat)
            refused = _refused(node, row.applied_plan_version, applied_plan_version)
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
            row.changed_seq = _bump_nodes(session)
            session.flush()
            return self._to_proto(row)

    def get(self, node: str) -> common_pb2.Node:
        check_node_name(node)
        with self._db.read() as session:
            row = session.connection().execute(_GET, {"g_name": node}).one_or_none()
        if row is None:
            raise NotFound(f"no node {node!r}", field="node")
        return self._row_to_proto(row)

    def list(self, *, pool: int = 0, alive_only: bool = False, liveness_window_s: float = 0.0,
             gpu_type: str = "") -> list[common_pb2.Node]:
        """The whole listing (ListNodes without changed_after)."""
        return self.listing(pool=pool, alive_only=alive_only, liveness_window_s=liveness_window_s,
                            gpu_type=gpu_type).nodes

    def listing(self, *, pool: int = 0, alive_only: bool = False, liveness_window_s: float = 0.0,
                gpu_type: str = "", changed_after: int = 0) -> NodeListing:
        """ListNodes: the whole listing as :meth:`list` answers it, or with ``changed_after`` the
        nodes changed since that cursor and the names of those not alive (ListNodesRequest)."""
        check_list_nodes(pool, liveness_window_s, gpu_type)
        check_node_changes(changed_after, pool=pool, alive_only=alive_only, gpu_type=gpu_type)
        window = timedelta(seconds=liveness_window_s) if liveness_window_s else self._window
        alive_since = utc_now() - window
        params = {"l_pool": pool, "l_gpu_type": gpu_type, "l_alive_since": alive_since,
                  "l_changed_after": changed_after}
        # Plain rows rather than ORM objects, the JSON columns as their text (see
        # convert.node_row_to_proto): the scheduler listed every node every second.
        with self._db.read() as session:
            connection = session.connection()
            # One snapshot for the count and the rows (Database.read). The count's row lock makes
            # changes commit in the order of their counts, so every change counted up to this
            # count is in the snapshot: none is skipped by the next listing, which starts after it.
            cursor = connection.execute(_NODES_COUNT).scalar_one_or_none() or 0
            whole = not changed_after or changed_after > cursor
            query = (_list_statement(bool(pool), bool(gpu_type), alive_only) if whole
                     else _CHANGED_AFTER)
            rows = connection.execute(query, params).all()
            not_alive = (list(connection.execute(_NOT_ALIVE, params).scalars()) if changed_after else [])
        to_datetime = self._to_datetime
        nodes = [convert.node_row_to_proto(row, alive_since=alive_since, to_datetime=to_datetime) for row in rows]
        return NodeListing(nodes=nodes, cursor=cursor, not_alive=not_alive, whole=whole)

    def _row_to_proto(self, row: Any) -> common_pb2.Node:
        """The Node of a row read as ``_ROW_COLUMNS``, alive as of now."""
        return convert.node_row_to_proto(row, alive_since=utc_now() - self._window, to_datetime=self._to_datetime)

    def _to_proto(self, row: Node) -> common_pb2.Node:
        return convert.node_to_proto(row, now=utc_now(), liveness_window_s=self._liveness_window_s)


def _refused(node: str, stored_version: int, applied_plan_version: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"must not decrease: node {node} already applied plan {stored_version}, got {applied_plan_version}",
        field="applied_plan_version",
    )


_NODES = Node.__table__
# What convert.node_row_to_proto reads, in its order: the JSON columns as their text and the
# times as the driver returns them (text on SQLite), so that an unchanged row is recognised
# without decoding anything (parsing 2,000 SQLite time strings was a third of a ListNodes).
_ROW_COLUMNS = (
    _NODES.c.name,
    cast(_NODES.c.spec, Text).label("spec"),
    type_coerce(_NODES.c.registered_at, NullType()).label("registered_at"),
    type_coerce(_NODES.c.last_heartbeat, NullType()).label("last_heartbeat"),
    _NODES.c.applied_plan_version,
    cast(_NODES.c.gpu_health, Text).label("gpu_health"),
)
_NAME = bindparam("h_name", type_=_NODES.c.name.type)
_NOW = bindparam("h_now", type_=_NODES.c.last_heartbeat.type)
_VERSION = bindparam("h_version", type_=_NODES.c.applied_plan_version.type)
_HEARTBEAT = (update(_NODES).where(_NODES.c.name == _NAME, _NODES.c.applied_plan_version <= _VERSION)
              .values(last_heartbeat=_NOW, applied_plan_version=_VERSION).returning(*_ROW_COLUMNS))
_PROOF_OF_LIFE = (update(_NODES).where(_NODES.c.name == _NAME).values(last_heartbeat=_NOW)
                  .returning(_NODES.c.applied_plan_version))
# The statements of the path that changes gpu_health (ORM: the row is read locked, changed and
# flushed), built once.
_ORM_HEARTBEAT = (update(Node).where(Node.name == _NAME, Node.applied_plan_version <= _VERSION)
                  .values(last_heartbeat=_NOW, applied_plan_version=_VERSION)
                  .execution_options(synchronize_session=False))
_ORM_LOCKED_NODE = (select(Node).where(Node.name == _NAME).execution_options(populate_existing=True)
                    .with_for_update())
_GET = select(*_ROW_COLUMNS).where(_NODES.c.name == bindparam("g_name", type_=_NODES.c.name.type))
_COUNTS = ChangeCount.__table__
_SET_CHANGED = (update(_NODES).where(_NODES.c.name == bindparam("c_name", type_=_NODES.c.name.type))
                .values(changed_seq=bindparam("c_seq", type_=_NODES.c.changed_seq.type)).returning(*_ROW_COLUMNS))
_BUMP_NODES = (update(_COUNTS).where(_COUNTS.c.name == "nodes")
               .values(value=_COUNTS.c.value + bindparam("c_by", type_=_COUNTS.c.value.type))
               .returning(_COUNTS.c.value))
_NODES_COUNT = select(_COUNTS.c.value).where(_COUNTS.c.name == "nodes")
_CHANGED_AFTER = (select(*_ROW_COLUMNS).order_by(_NODES.c.name)
                  .where(_NODES.c.changed_seq > bindparam("l_changed_after", type_=_NODES.c.changed_seq.type)))
_NOT_ALIVE = (select(_NODES.c.name).order_by(_NODES.c.name)
              .where(_NODES.c.last_heartbeat < bindparam("l_alive_since", type_=_NODES.c.last_heartbeat.type)))


# PostgreSQL: heartbeats as arrays (one statement for any number; psycopg2 sends lists as arrays).
_BEATS = (func.unnest(bindparam("h_names", type_=ARRAY(_NODES.c.name.type)),
                      bindparam("h_versions", type_=ARRAY(_NODES.c.applied_plan_version.type)))
          .table_valued(column("name", _NODES.c.name.type), column("version", _NODES.c.applied_plan_version.type))
          .render_derived(name="beats"))
_GROUPED_HEARTBEAT = (update(_NODES).where(_NODES.c.name == _BEATS.c.name, _NODES.c.applied_plan_version <= _BEATS.c.version)
                      .values(last_heartbeat=_NOW, applied_plan_version=_BEATS.c.version).returning(*_ROW_COLUMNS))
_LOCK_NODES = (select(_NODES.c.name).where(_NODES.c.name == func.any(bindparam("h_names", type_=ARRAY(_NODES.c.name.type))))
               .order_by(_NODES.c.name).with_for_update())


def _heartbeats_grouped(connection: Connection, beats: Sequence[tuple[str, int]], todo: Sequence[int],
                        results: list[Any], now: datetime) -> list[int]:
    """PostgreSQL: the first heartbeat of each node in ``todo`` as one UPDATE ... FROM unnest(...),
    after locking their rows in name order (so that two such batches wait for each other rather
    than deadlock). One statement per heartbeat cost a round trip each, most of the per-node work
    of a thousand nodes' heartbeats. Fills ``results`` of the heartbeats stored; returns, in order,
    those left to the one-by-one path: refused (an older version, no such node: it says why), and
    a node's later heartbeats in the batch."""
    first: dict[str, int] = {}
    for index in todo:
        first.setdefault(beats[index][0], index)
    names = sorted(first)
    connection.execute(_LOCK_NODES, {"h_names": names}).all()
    for row in connection.execute(_GROUPED_HEARTBEAT, {"h_names": names, "h_versions": [beats[first[n]][1] for n in names],
                                                        "h_now": now}):
        results[first[row.name]] = row
    return [index for index in todo if results[index] is None]


def _bump_nodes(session: Session | Connection, by: int = 1) -> int:
    """The node change count after ``by`` changes (the last of them), taken in ``session``'s
    transaction (its row stays locked to the commit)."""
    value = session.execute(_BUMP_NODES, {"c_by": by}).scalar_one_or_none()
    if value is None:  # migration 0011 made the row; a database emptied since has none
        dialect = session.get_bind().dialect if isinstance(session, Session) else session.dialect
        # Writers racing to make it: one makes it, the others wait for that and find it.
        session.execute(_insert_for(dialect.name)(_COUNTS).values(name="nodes", value=0).on_conflict_do_nothing())
        value = session.execute(_BUMP_NODES, {"c_by": by}).scalar_one()
    return int(value)


def _insert_for(dialect: str) -> Callable[..., Any]:
    """The INSERT with ON CONFLICT of ``dialect`` (the two databases the store runs on)."""
    return postgresql_insert if dialect == "postgresql" else sqlite_insert


def _register_statement(dialect: str) -> Insert:
    """UpsertNode's write (bound: u_name, u_pool, u_gpu_type, u_spec, u_now): a new node is
    registered now with plan 0 applied; a known one keeps its registration time, applied plan and
    GPU health."""
    columns = _NODES.c
    fields = {"pool": bindparam("u_pool", type_=columns.pool.type),
              "gpu_type": bindparam("u_gpu_type", type_=columns.gpu_type.type),
              "spec": bindparam("u_spec", type_=columns.spec.type),
              "last_heartbeat": bindparam("u_now", type_=columns.last_heartbeat.type)}
    statement = _insert_for(dialect)(_NODES).values(
        name=bindparam("u_name", type_=columns.name.type), registered_at=bindparam("u_now", type_=columns.registered_at.type),
        applied_plan_version=0, changed_seq=0, **fields)
    return statement.on_conflict_do_update(index_elements=[columns.name], set_=fields)


def _datetime_reader(dialect: Dialect) -> Callable[[Any], datetime]:
    """What the time columns' own type makes of a value as the driver returns it (an aware UTC datetime)."""
    column_type = _NODES.c.last_heartbeat.type
    process = column_type.dialect_impl(dialect).result_processor(dialect, None)
    return process if process is not None else as_utc


@functools.lru_cache(maxsize=None)
def _list_statement(by_pool: bool, by_gpu_type: bool, alive_only: bool) -> Select[Any]:
    """ListNodes' SELECT for one combination of filters (bound: l_pool, l_gpu_type, l_alive_since)."""
    query = select(*_ROW_COLUMNS).order_by(_NODES.c.name)
    if by_pool:
        query = query.where(_NODES.c.pool == bindparam("l_pool", type_=_NODES.c.pool.type))
    if by_gpu_type:
        query = query.where(_NODES.c.gpu_type == bindparam("l_gpu_type", type_=_NODES.c.gpu_type.type))
    if alive_only:
        query = query.where(_NODES.c.last_heartbeat >= bindparam("l_alive_since", type_=_NODES.c.last_heartbeat.type))
    return query
