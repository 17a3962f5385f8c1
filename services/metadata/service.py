"""``silod metadata``: the metadata store service (datasets, jobs, nodes, plans, metrics).

The only process that touches the database: SQLite for one machine, PostgreSQL for a cluster.
"""

from __future__ import annotations

import asyncio

import grpc
from pydantic import Field, field_validator
from silod.v1 import metadata_pb2_grpc

from services.metadata.compaction import compact_forever
from services.metadata.migrate import current_revision, head_revision, upgrade_engine
from services.metadata.database import normalize_db_url
from services.metadata.servicer import MetadataServicer
from services.metadata.store import MetadataStore
from services.metadata.store.retention import RetentionPolicy
from services.runtime.audit import StoreSink
from services.runtime.directory import LocalDirectory
from services.runtime.server import ServiceDefinition, StartupError
from services.runtime.settings import ServiceSettings
from services.runtime.structured_logging import get_logger

_log = get_logger("silod.metadata")


class Settings(ServiceSettings):
    db: str = Field(
        "sqlite:///silod-metadata.db",
        description="Database: a SQLite file (sqlite:///PATH, or just a path) or a postgresql://USER@HOST:PORT/DB URL",
    )
    auto_migrate: bool = Field(True, description="Apply pending schema migrations (Alembic upgrade head) at start")
    liveness_window_s: float = Field(
        15.0, gt=0, le=7 * 24 * 3600, description="Seconds since its last heartbeat within which a node counts as alive"
    )
    db_pool_size: int = Field(
        8, ge=1, le=256, description="Database connections kept open (as many more may be opened under load)"
    )
    retention_interval_s: float = Field(
        300.0, ge=0, description="Seconds between compactions that remove what the retention settings no longer "
        "keep (plans, metric samples, job events); 0 = never compact, keep everything")
    retention_plans_s: float = Field(
        6 * 3600.0, ge=0, description="Plans older than this are removed (the newest retention_min_plans stay); 0 = keep")
    retention_min_plans: int = Field(100, ge=1, description="The newest plans always kept, however old")
    retention_metrics_s: float = Field(24 * 3600.0, ge=0, description="Metric samples older than this are removed; 0 = keep")
    retention_finished_job_events_s: float = Field(
        30 * 86400.0, ge=0, description="Jobs that finished this long ago keep only their last event; 0 = keep all")
    retention_audit_s: float = Field(
        90 * 86400.0, ge=0, description="Audit log rows (who called what, when, with what outcome) older than this "
        "are removed; 0 = keep")

    @field_validator("db")
    @classmethod
    def _known_database(cls, value: str) -> str:
        normalize_db_url(value)  # raises ValueError naming the problem
        return value


def definition(settings: Settings) -> ServiceDefinition:
    # Connects lazily: on_start is the first thing that touches the database.
    store = MetadataStore.open(
        settings.db, liveness_window_s=settings.liveness_window_s, pool_size=settings.db_pool_size
    )

    def register(server: grpc.aio.Server) -> None:
        metadata_pb2_grpc.add_MetadataServiceServicer_to_server(MetadataServicer(store, settings.auth_token), server)

    compaction: list[asyncio.Task[None]] = []

    async def on_start() -> None:
        await asyncio.to_thread(_prepare_schema, store, settings)
        if settings.retention_interval_s > 0:
            policy = RetentionPolicy(plans_s=settings.retention_plans_s, min_plans=settings.retention_min_plans,
                                     metrics_s=settings.retention_metrics_s,
                                     finished_job_events_s=settings.retention_finished_job_events_s,
                                     audit_s=settings.retention_audit_s)
            compaction.append(asyncio.create_task(compact_forever(store, policy, settings.retention_interval_s)))

    async def on_stop() -> None:
        for task in compaction:
            task.cancel()
        await asyncio.to_thread(store.close)

    return ServiceDefinition(
        name="metadata",
        service_names=["silod.v1.MetadataService"],
        register=register,
        on_start=on_start,
        on_stop=on_stop,
        directory=LocalDirectory(store.access, store.datasets),
        audit_sink=StoreSink(store.audit),
    )


def _prepare_schema(store: MetadataStore, settings: Settings) -> None:
    engine = store.db.engine
    try:
        if settings.auto_migrate:
            upgrade_engine(engine)
        current, head = current_revision(engine), head_revision()
    except Exception as exc:
        raise StartupError(f"db: cannot prepare {engine.url.render_as_string(hide_password=True)}: {exc}") from exc
    if current != head:
        raise StartupError(
            f"db: schema is at revision {current or 'none'}, this silod needs {head}; "
            f"run `silod db upgrade --db URL` or start with --auto-migrate"
        )
    _log.info("database ready", extra={"db": engine.url.render_as_string(hide_password=True), "schema_revision": head})
