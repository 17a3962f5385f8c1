"""Alembic environment: runs on a connection handed over by services.metadata.migrate, or,
when invoked through the alembic CLI with services/metadata/alembic.ini, on its own engine."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from services.metadata.database import create_db_engine
from services.metadata.models import Base

# Any constant works; it only has to be the same for every silod process.
_MIGRATION_LOCK_KEY = 0x51_10D_DB


def _migrate(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Two services starting at once must not both create the schema. (SQLite is
            # already serialized: our transactions begin with BEGIN IMMEDIATE.)
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        context.run_migrations()


def _run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("db") or context.config.get_main_option("sqlalchemy.url")
    engine = create_db_engine(url)
    try:
        with engine.connect() as own_connection:
            _migrate(own_connection)
            own_connection.commit()
    finally:
        engine.dispose()


def _run_offline() -> None:
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=Base.metadata,
        render_as_batch=True,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    _run_offline()
else:
    _run_online()
