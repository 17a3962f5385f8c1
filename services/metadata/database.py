"""Engine and transactions for SQLite and PostgreSQL, tuned so that:

* an acknowledged write survives kill -9 (SQLite: WAL with synchronous=FULL);
* concurrent writers wait for each other instead of failing with "database is locked"
  (SQLite: every write transaction starts with BEGIN IMMEDIATE, so it takes the write lock
  up front and waits on busy_timeout, rather than upgrading a read lock and deadlocking);
* readers never block writers (SQLite WAL; PostgreSQL MVCC);
* concurrent SQLite writers of this process share commits (group commit, :class:`_GroupCommit`):
  each fsync'd commit costs milliseconds, and SQLite runs one writer at a time anyway.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session

_READ_ONLY_OPTION = "silod_read_only"


def normalize_db_url(db: str) -> URL:
    """Accept a SQLAlchemy URL, "postgresql://..." (psycopg2) or a plain SQLite file path."""
    text = db.strip()
    if not text:
        raise ValueError("empty database URL")
    if "://" not in text:
        text = "sqlite:///" + text
    try:
        url = make_url(text)
    except ArgumentError as exc:
        raise ValueError(f"not a database URL: {exc}") from None
    if url.get_backend_name() == "sqlite":
        if url.database in (None, "", ":memory:") or "mode=memory" in str(url):
            # Every pooled connection would see its own empty database.
            raise ValueError("in-memory SQLite is not supported; give a file, e.g. sqlite:///silod-metadata.db")
    elif url.get_backend_name() == "postgresql":
        if url.drivername == "postgresql":
            url = url.set(drivername="postgresql+psycopg2")
    else:
        raise ValueError(f"unsupported database {url.get_backend_name()!r}; use sqlite:///FILE or postgresql://...")
    return url


@dataclass(frozen=True)
class EngineOptions:
    pool_size: int = 8
    busy_timeout_s: float = 30.0


def create_db_engine(db: str, options: EngineOptions = EngineOptions()) -> Engine:
    url = normalize_db_url(db)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url, options)
    return create_engine(
        url,
        pool_size=options.pool_size,
        max_overflow=options.pool_size,
        pool_pre_ping=True,  # a restarted PostgreSQL leaves dead pooled connections behind
        connect_args={"connect_timeout": max(1, int(options.busy_timeout_s))},
    )


def _sqlite_engine(url: URL, options: EngineOptions) -> Engine:
    engine = create_engine(
        url,
        pool_size=options.pool_size,
        max_overflow=options.pool_size,
        # Connections move between worker threads, but the pool hands each to one thread at a time.
        connect_args={"check_same_thread": False, "timeout": options.busy_timeout_s},
    )
    busy_timeout_ms = int(options.busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's implicit BEGIN is always DEFERRED).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        read_only = connection.get_execution_options().get(_READ_ONLY_OPTION, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


# Every acknowledged write waits for one of these. On a disk shared with heavy writers the fsync
# alone can take tens of milliseconds, and submissions, heartbeats and reports all queue behind it.
SQLITE_COMMIT_SECONDS = Histogram(
    "silod_metadata_sqlite_commit_duration_seconds",
    "Time of each SQLite COMMIT of grouped writes (WAL, synchronous=FULL: one fsync each); "
    "slow ones mean the database's disk is busy",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

GROUP_COMMIT_MAX_OPS = 64  # operations sharing one SQLite commit, at most ...
GROUP_COMMIT_MAX_S = 0.05  # ... and seconds since the first of them ran, so none waits long


@dataclass
class _Batch:
    ops: int = 0
    started: float = field(default_factory=time.monotonic)
    committed: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _GroupCommit:
    """Write transactions of many threads on one SQLite connection, several per COMMIT.

    Each operation runs inside a SAVEPOINT of a shared transaction (its failure rolls back only
    its own work). When it is done and other writers are queued, it leaves the COMMIT to them
    and waits; the last writer of a batch commits for all. Nobody returns before the COMMIT that
    holds its work succeeded, so durability is what one commit per operation gave: with 8
    concurrent writers, one fsync instead of 8. A lone writer commits at once.

    A thread inside :meth:`batch` keeps the transaction for all its operations (each still its
    own SAVEPOINT) and commits once at the end: a call that moves hundreds of jobs pays one
    fsync, not hundreds.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._mutex = threading.Lock()  # owns the connection and the open transaction
        self._count_lock = threading.Lock()
        self._queued = 0
        self._conn: Connection | None = None
        self._batch: _Batch | None = None
        self._local = threading.local()  # .holding: this thread is inside batch()

    @contextmanager
    def write(self, core: bool = False) -> Iterator[Any]:
        if getattr(self._local, "holding", False):
            assert self._conn is not None
            with _savepoint(self._conn, core) as handle:
                yield handle
            return
        with self._transaction():
            assert self._conn is not None
            with _savepoint(self._conn, core) as handle:
                yield handle

    @contextmanager
    def batch(self) -> Iterator[None]:
        if getattr(self._local, "holding", False):
            yield
            return
        with self._transaction():
            self._local.holding = True
            try:
                yield
            finally:
                self._local.holding = False

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self._count_lock:
            self._queued += 1
        self._mutex.acquire()
        with self._count_lock:
            self._queued -= 1
        batch: _Batch | None = None
        try:
            if self._batch is None:
                if self._conn is None:
                    self._conn = self._engine.connect()
                self._conn.begin()  # BEGIN IMMEDIATE (see the "begin" listener)
                self._batch = _Batch()
            batch = self._batch
            batch.ops += 1
            yield
        finally:
            if batch is None:  # could not open a transaction: nothing of ours to commit
                self._drop_connection()
                self._mutex.release()
            else:
                self._finish(batch)
        # Only reached when the operation itself succeeded: it returns once its work is durable.
        if batch.error is not None:
            raise batch.error

    def _finish(self, batch: _Batch) -> None:
        """Commit now, or leave it to a queued writer; either way, wait until it happened."""
        with self._count_lock:
            others = self._queued
        if others and batch.ops < GROUP_COMMIT_MAX_OPS and time.monotonic() - batch.started < GROUP_COMMIT_MAX_S:
            self._mutex.release()
            batch.committed.wait()
            return
        try:
            assert self._conn is not None
            with SQLITE_COMMIT_SECONDS.time():  # an fsync: what a busy disk makes slow
                self._conn.commit()
        except BaseException as exc:  # noqa: BLE001  # every member of the batch must hear it
            batch.error = exc
            self._drop_connection()
        finally:
            self._batch = None
            batch.committed.set()
            self._mutex.release()

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()  # rolls back whatever is open
            except Exception:  # noqa: BLE001  # a broken connection is being thrown away anyway
                pass
            self._conn = None

    def close(self) -> None:
        with self._mutex:
            self._drop_connection()


@contextmanager
def _savepoint(conn: Connection, core: bool) -> Iterator[Any]:
    """One operation's SAVEPOINT on ``conn``: a Connection (``core``), or a Session joined to it."""
    if core and conn.dialect.name == "sqlite":
        # The driver's own statements: SQLAlchemy's begin_nested() compiles its SAVEPOINT and
        # RELEASE anew each time, which cost as much as the INSERTs of a job creation.
        raw = conn.connection.driver_connection
        raw.execute("SAVEPOINT silod_op")
        try:
            yield conn
        except BaseException:
            raw.execute("ROLLBACK TO silod_op")
            raw.execute("RELEASE silod_op")
            raise
        raw.execute("RELEASE silod_op")
        return
    if core:
        with conn.begin_nested():
            yield conn
        return
    with Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False) as session, \
            session.begin():
        yield session


class Database:
    """Hands out one transaction per store operation."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._group = _GroupCommit(engine) if engine.dialect.name == "sqlite" else None
        read_options: dict[str, Any] = {_READ_ONLY_OPTION: True}
        if engine.dialect.name == "postgresql":
            # One snapshot for all statements of a read, e.g. a dataset row and its manifest page.
            read_options["isolation_level"] = "REPEATABLE READ"
        self._read_engine = engine.execution_options(**read_options)
        self._local = threading.local()  # .conn: this thread's batch() transaction (PostgreSQL)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception; durable
        (committed) by the time the block has exited without an exception."""
        with self._write(False) as session:
            yield session

    @contextmanager
    def write_core(self) -> Iterator[Connection]:
        """As :meth:`write`, on a Core Connection: no ORM Session to build for an operation
        that runs prebuilt statements only (job creation and state moves)."""
        with self._write(True) as connection:
            yield connection

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Writes of this thread inside the block share one transaction, committed (durable)
        when the block exits; each write is still atomic on its own (a SAVEPOINT), so one that
        fails rolls back only itself. An exception leaving the block still commits the writes
        that succeeded, as separate writes would have been."""
        if self._group is not None:
            with self._group.batch():
                yield
            return
        if getattr(self._local, "conn", None) is not None:
            yield
            return
        with self.engine.connect() as conn:
            conn.begin()
            self._local.conn = conn
            try:
                yield
            finally:
                self._local.conn = None
                conn.commit()  # what succeeded; a failed write rolled back to its savepoint

    @contextmanager
    def _write(self, core: bool) -> Iterator[Any]:
        if self._group is not None:
            with self._group.write(core) as handle:
                yield handle
            return
        conn = getattr(self._local, "conn", None)
        if conn is not None:  # inside batch()
            with _savepoint(conn, core) as handle:
                yield handle
            return
        if core:
            with self.engine.begin() as connection:
                yield connection
            return
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only snapshot; on SQLite it does not take the write lock."""
        with Session(self._read_engine, expire_on_commit=False) as session, session.begin():
            yield session

    def dispose(self) -> None:
        if self._group is not None:
            self._group.close()
        self.engine.dispose()
