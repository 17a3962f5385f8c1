"""Fixtures: every test that takes ``db_url`` runs twice, on SQLite and on PostgreSQL.

Each test gets an empty, migrated database: SQLite by copying a template file migrated once
per session, PostgreSQL by truncating the tables of a database migrated once per session.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from services.metadata.database import create_db_engine
from services.metadata.migrate import upgrade
from services.metadata.models import Base
from services.metadata.service import Settings
from services.metadata.store import MetadataStore
from silod.v1 import metadata_pb2_grpc
from tests.support.fixtures import postgres_scratch
from tests.metadata.metadata_harness import InProcessServer, PostgresScratch

DATABASES = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresScratch]:
    yield from postgres_scratch()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")  # disposing the engine checkpoints the WAL into the file
    return path


@pytest.fixture(scope="session")
def postgres_migrated(postgres: PostgresScratch) -> str:
    url = postgres.create()
    upgrade(url)
    return url


def _truncate_all(url: str) -> None:
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    engine = create_db_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture(params=DATABASES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database at the newest schema."""
    if request.param == "sqlite":
        path = tmp_path / "metadata.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("postgres_migrated")
    _truncate_all(url)
    return url


@pytest.fixture(scope="module", params=DATABASES)
def module_db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An empty migrated database shared by one test module (for tests that only read or fail)."""
    if request.param == "sqlite":
        path = tmp_path_factory.mktemp("module-db") / "metadata.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url = request.getfixturevalue("postgres").create()
    upgrade(url)
    return url


@pytest.fixture(scope="module")
def module_server(module_db_url: str) -> Iterator[InProcessServer]:
    with InProcessServer(Settings(db=module_db_url, log_level="warning")) as running:
        yield running


@pytest.fixture
def store(db_url: str) -> Iterator[MetadataStore]:
    opened = MetadataStore.open(db_url)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def server(db_url: str) -> Iterator[InProcessServer]:
    with InProcessServer(Settings(db=db_url, log_level="warning")) as running:
        yield running


@pytest.fixture
def stub(server: InProcessServer) -> metadata_pb2_grpc.MetadataServiceStub:
    return server.stub
