"""Engine and transactions for SQLite and PostgreSQL, tuned so that:

* an acknowledged write survives kill -9 (SQLite: WAL with synchronous=FULL);
* concurrent writers wait for each other instead of failing with "database is locked"
  (SQLite: every write transaction starts with BEGIN IMMEDIATE, so it takes the write lock
  up front and waits on busy_timeout, rather than upgrading a read lock and deadlocking);
* readers never block writers (SQLite WAL; PostgreSQL MVCC).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event
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


class Database:
    """Hands out one transaction per store operation."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        read_options: dict[str, Any] = {_READ_ONLY_OPTION: True}
        if engine.dialect.name == "postgresql":
            # One snapshot for all statements of a read, e.g. a dataset row and its manifest page.
            read_options["isolation_level"] = "REPEATABLE READ"
        self._read_engine = engine.execution_options(**read_options)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only snapshot; on SQLite it does not take the write lock."""
        with Session(self._read_engine, expire_on_commit=False) as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
