"""Jobs: creation (idempotent on client_request_id), compare-and-set state moves (a move to a final
state revokes the job's credentials), progress and events."""

from __future__ import annotations

import functools
import json
import logging
import secrets
from datetime import datetime
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Text, Update, bindparam, cast, column, func, insert, select, update, values
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session
from silod.v1 import access_pb2, common_pb2, metadata_pb2

from services.metadata import convert, paging
from services.metadata.clock import utc_now
from services.metadata.database import Database
from services.metadata.job_states import RUNNING, TERMINAL_STATES, is_legal_move, state_name
from services.metadata.models import Credential, Job, JobEvent
from services.metadata.validation.common import check_enum, check_int, check_text
from services.metadata.validation.jobs import (
    check_client_request_id,
    check_event,
    check_job_id,
    check_progress,
    check_resources,
    check_transition,
    normalized_job_spec,
)
from services.runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ServiceError

STATE_EVENT = "state"
_log = logging.getLogger(__name__)
_ID_ATTEMPTS = 3  # 48 random bits: a second collision in a row would mean a broken RNG


def new_job_id() -> str:
    return "job-" + secrets.token_hex(6)


class JobStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def create(self, spec: common_pb2.JobSpec, client_request_id: str = "") -> common_pb2.Job:
        check_client_request_id(client_request_id)
        return self._create(normalized_job_spec(spec), client_request_id)

    def _create(self, spec: common_pb2.JobSpec, client_request_id: str) -> common_pb2.Job:
        for _ in range(_ID_ATTEMPTS):
            # Optimistic: a new request id is the common case, so insert first and look only
            # when the unique index refuses it (a retry, a concurrent twin, or an id collision).
            try:
                with self._db.write_core() as connection:
                    return _insert_jobs(connection, [(spec, client_request_id)])[0]
            except IntegrityError:
                # A write transaction, not a read: inside a batch (CreateJobs) the winner may be
                # an earlier, not yet committed, request of the same batch.
                with self._db.write_core() as connection:
                    winner = self._find_by_request_id(connection, client_request_id)
                if winner is not None:
                    return self._same_request_or_conflict(winner, spec)
        raise RuntimeError("could not allocate a unique job id")

    def create_many(self, requests: Sequence[tuple[common_pb2.JobSpec, str]]) -> list[common_pb2.Job | ServiceError]:
        """Each (spec, client_request_id) as :meth:`create` would (its own validation, idempotency
        and error), in one transaction: one commit for the lot. Results in order; a refused
        request's is the error, and the others are still created."""
        results: list[common_pb2.Job | ServiceError | None] = [None] * len(requests)
        valid: list[tuple[int, common_pb2.JobSpec, str]] = []
        for index, (spec, client_request_id) in enumerate(requests):
            try:
                check_client_request_id(client_request_id)
                valid.append((index, normalized_job_spec(spec), client_request_id))
            except ServiceError as exc:
                results[index] = exc
        with self._db.batch():
            keys = [key for _, _, key in valid if key]
            if len(valid) > 1 and len(set(keys)) == len(keys):
                # All new, as a rule: both INSERTs once for all of them (executemany). Should the
                # unique index refuse one (a retried request, an id collision), that savepoint
                # is rolled back and each is created on its own below.
                try:
                    with self._db.write_core() as connection:
                        jobs = _insert_jobs(connection, [(spec, key) for _, spec, key in valid])
                    for (index, _, _), job in zip(valid, jobs):
                        results[index] = job
                    valid = []
                except IntegrityError:
                    pass
            for index, spec, client_request_id in valid:
                try:
                    results[index] = self._create(spec, client_request_id)
                except ServiceError as exc:
                    results[index] = exc
        return results  # type: ignore[return-value]

    def get(self, job_id: str) -> common_pb2.Job:
        check_job_id(job_id)
        with self._db.read() as session:
            return convert.job_to_proto(_load(session, job_id))

    def list(
        self,
        *,
        states: Sequence[int] = (),
        tenant: str = "",
        application: str = "",
        kind: int = 0,
        page_size: int = 0,
        page_token: str = "",
        state_changed_since: datetime | None = None,
        view: int = 0,
        job_ids: Sequence[str] = (),
    ) -> tuple[list[common_pb2.Job], str]:
        """One page, in submission order; ``state_changed_since``: only jobs created or moved
        (a state change) at or after it; ``job_ids``: only these; ``view`` JOB_VIEW_STATE: each
        job's id, state and state_version only."""
        for index, state in enumerate(states):
            check_enum(state, common_pb2.JobState.DESCRIPTOR, f"states[{index}]")
        check_text(tenant, "tenant", max_chars=128)
        check_text(application, "application", max_chars=128)
        check_enum(kind, common_pb2.JobKind.DESCRIPTOR, "kind")
        check_enum(view, metadata_pb2.JobView.DESCRIPTOR, "view")
        if len(job_ids) > MAX_LISTED_IDS:
            raise InvalidArgument(f"at most {MAX_LISTED_IDS} ids, got {len(job_ids)}", field="job_ids")
        for index, job_id in enumerate(job_ids):
            check_job_id(job_id, f"job_ids[{index}]")
        size = paging.JOBS.size(page_size)
        after = paging.decode_token(page_token, "jobs", int)

        # Plain rows rather than ORM objects: a scheduler lists every active job each round, and
        # identity-map bookkeeping for 1,000 objects costs more than the query itself.
        states_only = view == metadata_pb2.JOB_VIEW_STATE
        query = select(*(_STATE_COLUMNS if states_only else _LIST_COLUMNS)).order_by(Job.seq).limit(size + 1)
        if job_ids:
            query = query.where(Job.id.in_(sorted(set(job_ids))))
        if after:
            query = query.where(Job.seq > after[0])
        if states:
            query = query.where(Job.state.in_(sorted(set(states))))
        if tenant:
            query = query.where(Job.tenant == tenant)
        if application:
            query = query.where(Job.application == application)
        if kind:
            query = query.where(Job.kind == kind)
        if state_changed_since is not None:
            # Creation and every state move write a "state" event at the time they change the row.
            query = query.where(Job.id.in_(select(JobEvent.job_id).where(
                JobEvent.time >= state_changed_since, JobEvent.type == STATE_EVENT)))
        with self._db.read() as session:
            rows = list(session.execute(query))
        page = rows[:size]
        next_token = paging.encode_token("jobs", page[-1].seq) if len(rows) > size else ""
        if states_only:
            return [common_pb2.Job(id=r.id, state=r.state, state_version=r.state_version) for r in page], next_token
        return [convert.listed_job_to_proto(row) for row in page], next_token

    def transition(self, job_id: str, expected_state: int, new_state: int, message: str = "") -> common_pb2.Job:
        check_job_id(job_id)
        check_transition(expected_state, new_state, message)
        # Prebuilt Core statements on the session's connection: a scheduling round moves
        # hundreds of jobs, and building and compiling ORM statements per call cost more than
        # executing them. UPDATE ... RETURNING does the compare-and-set and the read at once.
        with self._db.write_core() as connection:
            if not is_legal_move(expected_state, new_state):
                _check_move(job_id, _load_row(connection, job_id).state, expected_state, new_state)
            now = utc_now()
            row = connection.execute(_move_statement(new_state), {
                "m_id": job_id, "m_expected": expected_state, "m_new": new_state, "m_now": now, "m_message": message,
            }).one_or_none()
            if row is None:
                _check_move(job_id, _load_row(connection, job_id).state, expected_state, new_state)
                # Moved away and back between our UPDATE and this read (PostgreSQL, READ COMMITTED).
                raise FailedPrecondition(f"{job_id} changed state concurrently; re-read the job and retry",
                                         field="expected_state")
            connection.execute(_STATE_EVENT_INSERT, {
                "job_id": job_id, "sequence": row.last_event_sequence, "time": now, "type": STATE_EVENT,
                "from_state": expected_state, "to_state": new_state, "message": message,
            })
            if new_state in TERMINAL_STATES:  # the job's ranks' credentials end with it, in this transaction
                connection.execute(_REVOKE_JOB_CREDENTIALS, {"c_job": job_id, "c_now": now})
            return convert.job_to_proto(row)

    def transition_many(self, moves: Sequence[tuple[str, int, int, str]], *,
                        state_only: bool = False) -> list[common_pb2.Job | ServiceError]:
        """Each (job_id, expected_state, new_state, message) as :meth:`transition` would (its own
        compare-and-set), in one transaction: one commit for the lot. Results in order; a refused
        move's is the error, and the others still happen. ``state_only``: each job without its
        spec, progress and allocated (TransitionJobsRequest.state_only)."""
        results: list[common_pb2.Job | ServiceError | None] = [None] * len(moves)
        with self._db.batch():
            self._lock_in_id_order(job_id for job_id, *_ in moves)
            one_by_one = range(len(moves))
            if len({job_id for job_id, *_ in moves}) == len(moves) > 1:  # a job twice: its moves in order
                one_by_one = self._transition_grouped(moves, results, state_only)
            for index in one_by_one:
                try:
                    job = self.transition(*moves[index])
                except ServiceError as exc:
                    results[index] = exc
                    continue
                if state_only:
                    for name in ("spec", "progress", "allocated"):
                        job.ClearField(name)
                results[index] = job
        return results  # type: ignore[return-value]  # every index was filled

    def _lock_in_id_order(self, job_ids: Iterable[str]) -> None:
        """PostgreSQL: lock the rows of ``job_ids`` now, in id order, for the rest of the batch's
        transaction. Every batch write of jobs takes its rows in that order (progress too), so two
        batches wait for each other rather than deadlock: moved one UPDATE per kind of move, a
        batch would take its rows kind by kind, and two batches whose kinds cross (a round's
        commit, the moves task reports make) deadlocked, each then falling back to a transaction
        per job. SQLite has one writer at a time: nothing to order."""
        if self._db.dialect != "postgresql":
            return
        ids = []
        for job_id in set(job_ids):
            try:
                check_job_id(job_id)  # the moves refuse the others themselves, each on its own
            except ServiceError:
                continue
            ids.append(job_id)
        ids.sort()
        try:
            with self._db.write_core() as connection:
                _lock_rows(connection, ids)
        except SQLAlchemyError:  # the moves still happen, each compare-and-set as safe as before
            _log.warning("could not lock the batch's jobs first", exc_info=True)

    def _transition_grouped(self, moves: Sequence[tuple[str, int, int, str]],
                            results: list[common_pb2.Job | ServiceError | None], state_only: bool) -> list[int]:
        """The moves that share (expected, new, message) as one UPDATE ... RETURNING, and all
        their events as one INSERT: a round's commit moves hundreds of jobs alike, and on
        PostgreSQL the savepoint and two statements per move cost a millisecond each. Fills
        ``results``; returns the indices left to :meth:`transition` (refused by the
        compare-and-set, or a move that is not a legal edge: it says why). All or nothing: a
        database error leaves every move to :meth:`transition`."""
        left: list[int] = []
        groups: dict[tuple[int, int, str], list[int]] = {}
        for index, (job_id, expected_state, new_state, message) in enumerate(moves):
            try:
                check_job_id(job_id)
                check_transition(expected_state, new_state, message)
            except ServiceError as exc:
                results[index] = exc
                continue
            if is_legal_move(expected_state, new_state):
                groups.setdefault((expected_state, new_state, message), []).append(index)
            else:
                left.append(index)
        done: dict[int, common_pb2.Job] = {}
        try:
            with self._db.write_core() as connection:
                now = utc_now()
                events: list[dict[str, Any]] = []
                ended: list[str] = []
                for (expected_state, new_state, message), indices in groups.items():
                    indices = sorted(indices, key=lambda i: moves[i][0])
                    for start in range(0, len(indices), _GROUP_MOVES):
                        chunk = indices[start:start + _GROUP_MOVES]
                        rows = {row.id: row for row in connection.execute(_group_move_statement(new_state, state_only), {
                            "m_ids": [moves[i][0] for i in chunk], "m_expected": expected_state, "m_new": new_state,
                            "m_now": now, "m_message": message})}
                        for index in chunk:
                            row = rows.get(moves[index][0])
                            if row is None:  # not in the expected state, or no such job
                                left.append(index)
                                continue
                            done[index] = convert.job_state_to_proto(row) if state_only else convert.job_to_proto(row)
                            events.append({"job_id": row.id, "sequence": row.last_event_sequence, "time": now,
                                           "type": STATE_EVENT, "from_state": expected_state, "to_state": new_state,
                                           "message": message})
                            if new_state in TERMINAL_STATES:
                                ended.append(row.id)
                if events:
                    connection.execute(_STATE_EVENT_INSERT, events)
                if ended:
                    connection.execute(_REVOKE_JOBS_CREDENTIALS, {"c_jobs": ended, "c_now": now})
        except SQLAlchemyError:
            _log.warning("grouped job moves failed; moving each on its own", exc_info=True)
            return sorted(set(left) | {i for indices in groups.values() for i in indices})
        for index, job in done.items():
            results[index] = job
        return sorted(left)

    def update_progress(
        self,
        job_id: str,
        progress: common_pb2.JobProgress | None,
        allocated: common_pb2.ResourceVector | None = None,
    ) -> common_pb2.Job:
        check_job_id(job_id)
        if progress is not None:
            check_progress(progress)
        if allocated is not None:
            check_resources(allocated, "allocated")
        with self._db.write() as session:
            row = _load(session, job_id)
            if progress is not None:
                row.progress = convert.to_json(progress)
            if allocated is not None:
                row.allocated = convert.to_json(allocated)
            row.updated_at = utc_now()
            session.flush()
            return convert.job_to_proto(row)

    def update_progress_many(
        self, updates: Sequence[tuple[str, common_pb2.JobProgress | None, common_pb2.ResourceVector | None]],
    ) -> list[ServiceError | None]:
        """Each (job_id, progress, allocated) as :meth:`update_progress` would store it (same
        checks, same messages), in one transaction: one commit for the lot, and no job read back.
        Results in order: None where stored, the error where refused; the others are still stored."""
        results: list[ServiceError | None] = [None] * len(updates)
        rows: list[tuple[int, dict[str, Any]]] = []
        now = utc_now()
        for index, (job_id, progress, allocated) in enumerate(updates):
            try:
                check_job_id(job_id)
                if progress is not None:
                    check_progress(progress)
                if allocated is not None:
                    check_resources(allocated, "allocated")
            except ServiceError as exc:
                results[index] = exc
                continue
            values: dict[str, Any] = {"p_id": job_id, "p_now": now}
            if progress is not None:
                values["p_progress"] = convert.to_json(progress)
            if allocated is not None:
                values["p_allocated"] = convert.to_json(allocated)
            rows.append((index, values))
        rows.sort(key=lambda row: row[1]["p_id"])  # id order, as moves lock
        with self._db.write_core() as connection:
            if connection.dialect.name == "postgresql":
                _update_progress_grouped(connection, rows, results, now)
                return results
            for index, values in rows:
                # One prebuilt UPDATE per shape (which of the two columns it sets), not the ORM
                # load-modify-flush of update_progress: a thousand of these arrive per second.
                statement = _progress_statement("p_progress" in values, "p_allocated" in values)
                if connection.execute(statement, values).rowcount != 1:
                    results[index] = NotFound(f"no job {values['p_id']!r}", field="job_id")
        return results

    def append_event(self, job_id: str, event_type: str, message: str = "") -> common_pb2.JobEvent:
        check_job_id(job_id)
        check_event(event_type, message)
        with self._db.write() as session:
            sequence = _next_event_sequence(session, job_id)
            event = JobEvent(
                job_id=job_id,
                sequence=sequence,
                time=utc_now(),
                type=event_type,
                from_state=common_pb2.JOB_STATE_UNSPECIFIED,
                to_state=common_pb2.JOB_STATE_UNSPECIFIED,
                message=message,
            )
            session.add(event)
            return convert.event_to_proto(event)

    def list_events(self, job_id: str, after_sequence: int = 0, limit: int = 0) -> list[common_pb2.JobEvent]:
        check_job_id(job_id)
        check_int(after_sequence, "after_sequence", minimum=0, maximum=2**63 - 1)
        size = paging.JOB_EVENTS.size(limit, field="limit")
        with self._db.read() as session:
            _load(session, job_id)
            rows = session.scalars(
                select(JobEvent)
                .where(JobEvent.job_id == job_id, JobEvent.sequence > after_sequence)
                .order_by(JobEvent.sequence)
                .limit(size)
            )
            return [convert.event_to_proto(row) for row in rows]

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _find_by_request_id(connection: Connection, client_request_id: str) -> Any:
        if not client_request_id:
            return None
        return connection.execute(_BY_REQUEST_ID, {"r_id": client_request_id}).one_or_none()

    @staticmethod
    def _same_request_or_conflict(existing: Any, spec: common_pb2.JobSpec) -> common_pb2.Job:
        job = convert.job_to_proto(existing)
        if job.spec != spec:
            raise AlreadyExists(
                f"{existing.client_request_id!r} was already used for {existing.id} with a different spec",
                field="client_request_id",
            )
        return job


_JOBS = Job.__table__
_STATE_EVENT_INSERT = insert(JobEvent.__table__)
_CREDENTIALS = Credential.__table__
_REVOKE_JOB_CREDENTIALS = (
    update(_CREDENTIALS)
    .where(_CREDENTIALS.c.kind == access_pb2.PRINCIPAL_KIND_JOB, _CREDENTIALS.c.name == bindparam("c_job"),
           _CREDENTIALS.c.revoked_at.is_(None))
    .values(revoked_at=bindparam("c_now", type_=_CREDENTIALS.c.revoked_at.type)))
_REVOKE_JOBS_CREDENTIALS = (
    update(_CREDENTIALS)
    .where(_CREDENTIALS.c.kind == access_pb2.PRINCIPAL_KIND_JOB,
           _CREDENTIALS.c.name.in_(bindparam("c_jobs", expanding=True)), _CREDENTIALS.c.revoked_at.is_(None))
    .values(revoked_at=bindparam("c_now", type_=_CREDENTIALS.c.revoked_at.type)))


_GROUP_MOVES = 500  # job ids bound in one UPDATE of _transition_grouped (SQLite allows 32,766 variables)
# Locks rows in the ORDER BY's order: PostgreSQL locks the rows a SELECT ... FOR UPDATE returns
# after sorting them (what an UPDATE ... WHERE id IN (...) locks follows its scan, a bitmap scan's
# being the table's physical order).
_LOCK_JOBS = (select(_JOBS.c.id).where(_JOBS.c.id.in_(bindparam("m_ids", expanding=True)))
              .order_by(_JOBS.c.id).with_for_update())


@functools.lru_cache(maxsize=None)
def _move_statement(new_state: int) -> Update:
    """The compare-and-set UPDATE of a job's state (bound: m_id, m_expected, m_new, m_now,
    m_message), built once per target state: the columns it sets depend on that state only."""
    # The WHERE on the state is what makes concurrent movers safe.
    return (update(_JOBS).where(_JOBS.c.id == bindparam("m_id"), _JOBS.c.state == bindparam("m_expected"))
            .values(**_move_values(new_state)).returning(*_JOBS.columns))


@functools.lru_cache(maxsize=None)
def _group_move_statement(new_state: int, state_only: bool = False) -> Update:
    """_move_statement for many jobs at once (bound: m_ids, a list, instead of m_id); with
    ``state_only``, returning the columns convert.job_state_to_proto reads (no JSON to decode)."""
    return (update(_JOBS).where(_JOBS.c.id.in_(bindparam("m_ids", expanding=True)),
                                _JOBS.c.state == bindparam("m_expected"))
            .values(**_move_values(new_state))
            .returning(*(_MOVED_COLUMNS if state_only else _JOBS.columns)))


_MOVED_COLUMNS = tuple(_JOBS.c[name] for name in (
    "id", "state", "client_request_id", "state_version", "created_at", "updated_at", "started_at", "finished_at",
    "message", "last_event_sequence"))


def _move_values(new_state: int) -> dict[str, object]:
    now = bindparam("m_now", type_=_JOBS.c.updated_at.type)
    values: dict[str, object] = {
        "state": bindparam("m_new"),
        "state_version": _JOBS.c.state_version + 1,
        "updated_at": now,
        "message": bindparam("m_message"),
        "last_event_sequence": _JOBS.c.last_event_sequence + 1,
    }
    if new_state == RUNNING:
        values["started_at"] = func.coalesce(_JOBS.c.started_at, now)
    if new_state in TERMINAL_STATES:
        values["finished_at"] = now
    return values


# JSON columns as their text: unchanged rows are recognised without decoding them (convert._JobMemo).
def _lock_rows(connection: Connection, sorted_ids: Sequence[str]) -> None:
    """Lock these jobs' rows (PostgreSQL), in the order given: job id order, as every batch
    write of jobs takes them (JobStore._lock_in_id_order says why)."""
    for start in range(0, len(sorted_ids), _GROUP_MOVES):
        connection.execute(_LOCK_JOBS, {"m_ids": list(sorted_ids[start:start + _GROUP_MOVES])}).all()


def _update_progress_grouped(connection: Connection, rows: Sequence[tuple[int, dict[str, Any]]],
                             results: list[ServiceError | None], now: datetime) -> None:
    """PostgreSQL: the progress writes of a batch (in job id order) as one UPDATE ... FROM
    (VALUES ...) per shape and 500 jobs, after locking their rows in id order. One statement per
    job cost a round trip each: a batch of a thousand took a second, holding its rows' locks,
    and the round's state moves waited behind it."""
    _lock_rows(connection, [values["p_id"] for _, values in rows])
    shapes: dict[tuple[bool, bool], list[tuple[int, dict[str, Any]]]] = {}
    for row in rows:
        shapes.setdefault(("p_progress" in row[1], "p_allocated" in row[1]), []).append(row)
    for (progress, allocated), shaped in shapes.items():
        for start in range(0, len(shaped), _GROUP_MOVES):
            chunk = shaped[start:start + _GROUP_MOVES]
            columns = [column("id", _JOBS.c.id.type)]
            if progress:
                columns.append(column("progress", Text))
            if allocated:
                columns.append(column("allocated", Text))
            table = values(*columns, name="written").data([
                (v["p_id"], *([json.dumps(v["p_progress"])] if progress else []),
                 *([json.dumps(v["p_allocated"])] if allocated else [])) for _, v in chunk])
            sets: dict[str, object] = {"updated_at": bindparam("p_now", type_=_JOBS.c.updated_at.type)}
            if progress:
                sets["progress"] = cast(table.c.progress, _JOBS.c.progress.type)
            if allocated:
                sets["allocated"] = cast(table.c.allocated, _JOBS.c.allocated.type)
            statement = update(_JOBS).where(_JOBS.c.id == table.c.id).values(**sets).returning(_JOBS.c.id)
            stored = set(connection.execute(statement, {"p_now": now}).scalars())
            for index, v in chunk:
                if v["p_id"] not in stored:
                    results[index] = NotFound(f"no job {v['p_id']!r}", field="job_id")


@functools.lru_cache(maxsize=None)
def _progress_statement(progress: bool, allocated: bool) -> Update:
    """The UPDATE of a job's progress and/or allocation (bound: p_id, p_now, p_progress, p_allocated)."""
    values: dict[str, object] = {"updated_at": bindparam("p_now", type_=_JOBS.c.updated_at.type)}
    if progress:
        values["progress"] = bindparam("p_progress", type_=_JOBS.c.progress.type)
    if allocated:
        values["allocated"] = bindparam("p_allocated", type_=_JOBS.c.allocated.type)
    return update(_JOBS).where(_JOBS.c.id == bindparam("p_id")).values(**values)


_LIST_COLUMNS = [cast(c, Text).label(c.name) if c.name in ("spec", "progress", "allocated") else c for c in _JOBS.columns]
_STATE_COLUMNS = [Job.seq, Job.id, Job.state, Job.state_version]  # JOB_VIEW_STATE
MAX_LISTED_IDS = 1000  # ListJobsRequest.job_ids
_BY_REQUEST_ID = select(*_JOBS.columns).where(_JOBS.c.client_request_id == bindparam("r_id"))


_JOB_INSERT_PLAIN = insert(_JOBS)
_BY_ID = select(*_JOBS.columns).where(_JOBS.c.id == bindparam("j_id"))


def _insert_job(connection: Connection | Session, spec: common_pb2.JobSpec, client_request_id: str) -> common_pb2.Job:
    if isinstance(connection, Session):
        connection = connection.connection()
    return _insert_jobs(connection, [(spec, client_request_id)])[0]


def _insert_jobs(connection: Connection, requests: Sequence[tuple[common_pb2.JobSpec, str]]) -> list[common_pb2.Job]:
    """New PENDING jobs and their "submitted" events, as prebuilt Core statements (as transition
    does: submissions arrive by the hundred per second), each run once for all of them. The
    jobs are answered from what was written, not read back: every column is known here."""
    jobs, events = [], []
    answers: list[common_pb2.Job] = []
    for spec, client_request_id in requests:
        now = utc_now()  # each its own: submission order is creation order (FIFO sorts on it)
        spec_json = convert.to_json(spec)
        job_id = new_job_id()
        jobs.append({
            "id": job_id, "client_request_id": client_request_id or None, "name": spec.name, "tenant": spec.tenant,
            "application": spec.application, "kind": spec.kind, "state": common_pb2.JOB_STATE_PENDING,
            "spec": spec_json, "state_version": 1, "created_at": now, "updated_at": now, "started_at": None,
            "finished_at": None, "progress": {}, "allocated": {}, "message": "", "last_event_sequence": 1,
        })
        events.append({
            "job_id": job_id, "sequence": 1, "time": now, "type": STATE_EVENT,
            "from_state": common_pb2.JOB_STATE_UNSPECIFIED, "to_state": common_pb2.JOB_STATE_PENDING,
            "message": "submitted",
        })
        answers.append(convert.new_job_proto(job_id, spec, spec_json, client_request_id, now))
    connection.execute(_JOB_INSERT_PLAIN, jobs)
    connection.execute(_STATE_EVENT_INSERT, events)
    return answers


def _load_row(connection: Connection, job_id: str) -> Any:
    row = connection.execute(_BY_ID, {"j_id": job_id}).one_or_none()
    if row is None:
        raise NotFound(f"no job {job_id!r}", field="job_id")
    return row


def _load(session: Session, job_id: str, *, refresh: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if refresh:
        query = query.execution_options(populate_existing=True)
    row = session.scalars(query).one_or_none()
    if row is None:
        raise NotFound(f"no job {job_id!r}", field="job_id")
    return row


def _check_move(job_id: str, actual: int, expected: int, new: int) -> None:
    if actual != expected:
        raise FailedPrecondition(
            f"{job_id} is {state_name(actual)}, not {state_name(expected)}; re-read the job and retry",
            field="expected_state",
        )
    if not is_legal_move(expected, new):
        raise FailedPrecondition(
            f"illegal move from {state_name(expected)} to {state_name(new)}", field="new_state"
        )


def _next_event_sequence(session: Session, job_id: str) -> int:
    # The UPDATE locks the job row, so concurrent appenders get consecutive sequences.
    bumped = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(last_event_sequence=Job.last_event_sequence + 1)
        .execution_options(synchronize_session=False)
    )
    if bumped.rowcount != 1:
        raise NotFound(f"no job {job_id!r}", field="job_id")
    return session.scalars(select(Job.last_event_sequence).where(Job.id == job_id)).one()
