"""Schema migrations, run programmatically so they work from an installed wheel.

``silod db upgrade --db URL`` and the metadata service (with auto_migrate) call upgrade().
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from services.metadata.database import EngineOptions, create_db_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def upgrade(db_url: str, revision: str = "head") -> None:
    """Bring the database at ``db_url`` to the newest schema (or ``revision``); a no-op when it is already there."""
    engine = create_db_engine(db_url, EngineOptions(pool_size=1))
    try:
        upgrade_engine(engine, revision)
    finally:
        engine.dispose()


def upgrade_engine(engine: Engine, revision: str = "head") -> None:
    config = _config()
    # One transaction for the whole upgrade: a crash half-way leaves the old schema.
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None, "the migrations package has no revisions"
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
