"""Tables of the metadata store (SQLAlchemy 2 typed declarative).

Enums are stored as their protobuf numbers, and nested protobuf values as JSON written by
json_format with the proto field names, so the schema does not change when a message grows.
Columns that ListJobs filters on are copied out of the JSON spec and indexed.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from services.metadata.clock import as_utc

# Explicit constraint names keep Alembic batch migrations on SQLite able to find them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
AutoIncrementId = BigInteger().with_variant(Integer(), "sqlite")

# Byte (code point) order on both databases, so paging by key agrees with Python's sorted().
ObjectKey = String(1024).with_variant(String(1024, collation="C"), "postgresql")


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, on both databases.

    SQLite stores naive text, so the offset is dropped on the way in (all values are UTC,
    which keeps the text sortable) and restored on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Dataset(Base):
    __tablename__ = "datasets"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    storage_options: Mapped[dict[str, str]] = mapped_column(JSON)
    description: Mapped[str] = mapped_column(Text)
    tenant: Mapped[str] = mapped_column(String(128), index=True, default="default")  # the owning tenant
    shared: Mapped[bool] = mapped_column(Boolean, default=False)  # readable by every tenant (set by admins)
    manifest_version: Mapped[int] = mapped_column(BigInteger)
    num_objects: Mapped[int] = mapped_column(BigInteger)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    registered_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class DatasetObject(Base):
    """One manifest entry. Only rows of the dataset's current manifest_version are live."""

    __tablename__ = "dataset_objects"

    dataset_name: Mapped[str] = mapped_column(
        String(128), ForeignKey("datasets.name", ondelete="CASCADE"), primary_key=True
    )
    manifest_version: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    key: Mapped[str] = mapped_column(ObjectKey, primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    etag: Mapped[str] = mapped_column(String(256))


class Job(Base):
    __tablename__ = "jobs"

    # Submission order for ListJobs paging; the public id is random so it reveals nothing.
    seq: Mapped[int] = mapped_column(AutoIncrementId, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True)
    # NULL when the client gave none: unique constraints ignore NULLs on both databases.
    client_request_id: Mapped[str | None] = mapped_column(String(128), unique=True)
    name: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    application: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[int] = mapped_column(Integer, index=True)
    state: Mapped[int] = mapped_column(Integer, index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state_version: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    progress: Mapped[dict[str, Any]] = mapped_column(JSON)
    allocated: Mapped[dict[str, Any]] = mapped_column(JSON)
    message: Mapped[str] = mapped_column(Text)
    # Bumped with UPDATE ... SET x = x + 1 so concurrent appenders serialize on the job row.
    last_event_sequence: Mapped[int] = mapped_column(BigInteger)


class JobEvent(Base):
    __tablename__ = "job_events"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    sequence: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    # Indexed: a scheduler asks which jobs changed state since a time (ListJobsRequest.state_changed_since).
    time: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    type: Mapped[str] = mapped_column(String(64))
    from_state: Mapped[int] = mapped_column(Integer)
    to_state: Mapped[int] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text)


class Node(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    pool: Mapped[int] = mapped_column(Integer, index=True)
    # Also in spec; a column of its own so that ListNodes filters by type in the database.
    gpu_type: Mapped[str] = mapped_column(String(32), index=True, default="")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    registered_at: Mapped[datetime] = mapped_column(UtcDateTime)
    last_heartbeat: Mapped[datetime] = mapped_column(UtcDateTime)
    applied_plan_version: Mapped[int] = mapped_column(BigInteger)
    # The GPUs' latest NVML figures, their latched faults and accepted ECC counts
    # (services/metadata/store/gpu_health.py); NULL for a node that never sent any.
    gpu_health: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True, default=None)
    # The node_changes count when the node last registered, changed its spec or got or lost a GPU
    # fault (never by heartbeats alone): ListNodes answers changes after a cursor by it.
    changed_seq: Mapped[int] = mapped_column(BigInteger, index=True, default=0)


class ChangeCount(Base):
    """A count bumped by each change of its kind, in the changing transaction: the row lock orders
    the changes' commits as their counts, so a reader that saw count N has seen every change up to
    N (store/nodes.py; a database sequence is not transactional and would not)."""

    __tablename__ = "change_counts"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class Plan(Base):
    __tablename__ = "plans"

    # The primary key is what makes concurrent commits of one version race-free, across
    # processes and databases: exactly one INSERT wins.
    version: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    policy: Mapped[str] = mapped_column(String(128))
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Set: ``plan`` holds only what this plan changes of that version (PlanChanges); NULL: the whole plan.
    base_version: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class MetricSample(Base):
    __tablename__ = "metric_samples"
    __table_args__ = (Index("ix_metric_samples_job_id_time", "job_id", "time"),)

    id: Mapped[int] = mapped_column(AutoIncrementId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"))
    time: Mapped[datetime] = mapped_column(UtcDateTime)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Double)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)


class JobModel(Base):
    __tablename__ = "job_models"

    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    application: Mapped[str] = mapped_column(String(128))
    params: Mapped[dict[str, float]] = mapped_column(JSON)
    observations: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Tenant(Base):
    """A team sharing the cluster; JobSpec.tenant names one. Users see and act on its jobs
    through membership (TenantMember)."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class TenantMember(Base):
    __tablename__ = "tenant_members"

    tenant: Mapped[str] = mapped_column(String(128), ForeignKey("tenants.name", ondelete="CASCADE"), primary_key=True)
    # Users exist only as names their credentials and memberships share: there is no user table.
    user: Mapped[str] = mapped_column(String(128), primary_key=True, index=True)


class TenantQuotaRow(Base):
    """A tenant's quota (access_pb2.TenantQuota as JSON, proto field names); no row = no quota."""

    __tablename__ = "tenant_quotas"

    tenant: Mapped[str] = mapped_column(String(128), ForeignKey("tenants.name", ondelete="CASCADE"), primary_key=True)
    quota: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class Credential(Base):
    """A bearer credential: only the SHA-256 of its random secret is kept (the token is shown once)."""

    __tablename__ = "credentials"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    kind: Mapped[int] = mapped_column(Integer)  # PrincipalKind number
    name: Mapped[str] = mapped_column(String(128), index=True)
    description: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class SchedulerLease(Base):
    """Who leads the schedulers (one row, name "scheduler"): taken by compare-and-set once
    expired, the epoch incrementing at each change of holder (services.metadata.store.leadership)."""

    __tablename__ = "scheduler_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    address: Mapped[str] = mapped_column(String(256))
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)


class AuditEvent(Base):
    """One call the audit log recorded (services/runtime/audit.py says which): who, what, when,
    outcome and from where. Kept ``retention_audit_s`` (services/metadata/store/retention.py)."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(AutoIncrementId, primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    principal_kind: Mapped[int] = mapped_column(Integer)  # PrincipalKind number; 0 = not authenticated
    principal_name: Mapped[str] = mapped_column(String(128), index=True)
    credential_id: Mapped[str] = mapped_column(String(32))  # "" = the cluster token or none
    method: Mapped[str] = mapped_column(String(160))  # full gRPC method name
    job_id: Mapped[str] = mapped_column(String(64), index=True)  # resource ids the request named, "" = none
    dataset: Mapped[str] = mapped_column(String(256))
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    node: Mapped[str] = mapped_column(String(128))
    code: Mapped[int] = mapped_column(Integer)  # gRPC status code number, 0 = OK
    message: Mapped[str] = mapped_column(Text)
    peer: Mapped[str] = mapped_column(String(256))  # the caller's address as gRPC reports it
    service: Mapped[str] = mapped_column(String(64))  # the silod process that served the call
    reporter: Mapped[str] = mapped_column(String(160))  # who handed the event in (AppendAuditEvents' caller)
