"""Alembic: the migrations create the schema, are idempotent, match the models and ship in the wheel."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import setuptools
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from services.metadata.database import create_db_engine
from services.metadata.migrate import MIGRATIONS_DIR, current_revision, head_revision, upgrade
from services.metadata.models import Base
from services.metadata.service import Settings, definition
from services.metadata.store import MetadataStore
from services.runtime.server import StartupError, start_server
from tests.metadata.metadata_harness import InProcessServer, PostgresScratch
from tests.metadata.metadata_samples import create_job, training_spec
from tests.support.procs import REPO_ROOT

SCHEMA_TABLES = {table.name for table in Base.metadata.sorted_tables}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
    else:
        postgres: PostgresScratch = request.getfixturevalue("postgres")
        yield postgres.create()


def tables_and_revision(url: str) -> tuple[set[str], str | None]:
    engine = create_db_engine(url)
    try:
        return set(inspect(engine).get_table_names()), current_revision(engine)
    finally:
        engine.dispose()


def test_upgrade_creates_the_schema_and_a_second_run_changes_nothing(empty_db_url):
    assert tables_and_revision(empty_db_url) == (set(), None)
    upgrade(empty_db_url)
    tables, revision = tables_and_revision(empty_db_url)
    assert tables == SCHEMA_TABLES | {"alembic_version"} and revision == head_revision()

    store = MetadataStore.open(empty_db_url)
    try:
        job = store.jobs.create(training_spec())
        upgrade(empty_db_url)
        assert store.jobs.get(job.id) == job, "re-running the upgrade keeps the data"
    finally:
        store.close()
    assert tables_and_revision(empty_db_url) == (SCHEMA_TABLES | {"alembic_version"}, head_revision())


def test_models_and_migrations_agree(empty_db_url):
    upgrade(empty_db_url)
    engine = create_db_engine(empty_db_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_server_migrates_an_empty_database_at_start(empty_db_url):
    with InProcessServer(Settings(db=empty_db_url, log_level="warning")) as server:
        assert create_job(server.stub).state == 1


def test_server_without_auto_migrate_refuses_an_old_schema(tmp_path):
    settings = Settings(db=f"sqlite:///{tmp_path / 'never-migrated.db'}", auto_migrate=False)
    with pytest.raises(StartupError, match="silod db upgrade"):
        asyncio.run(start_server(definition(settings), settings))


def test_silod_db_upgrade_command(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    for _ in range(2):  # the second run is a no-op
        done = subprocess.run(
            [sys.executable, "-m", "silod.cli", "db", "upgrade", "--db", url],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert tables_and_revision(url)[1] == head_revision()


def test_migrations_are_packaged():
    packages = setuptools.find_packages(where=str(REPO_ROOT), include=["services*"])
    assert {"services.metadata.migrations", "services.metadata.migrations.versions"} <= set(packages)
    assert (MIGRATIONS_DIR / "script.py.mako").is_file() and (MIGRATIONS_DIR.parent / "alembic.ini").is_file()
