"""The audit log: one row per recorded call (who, what, when, outcome, peer), kept for a retention
period (services/metadata/store/audit.py, services/runtime/audit.py).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 02:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("principal_kind", sa.Integer(), nullable=False),
        sa.Column("principal_name", sa.String(length=128), nullable=False),
        sa.Column("credential_id", sa.String(length=32), nullable=False),
        sa.Column("method", sa.String(length=160), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("dataset", sa.String(length=256), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("code", sa.Integer(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("peer", sa.String(length=256), nullable=False),
        sa.Column("service", sa.String(length=64), nullable=False),
        sa.Column("reporter", sa.String(length=160), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    with op.batch_alter_table("audit_events") as batch:
        batch.create_index(batch.f("ix_audit_events_time"), ["time"], unique=False)
        batch.create_index(batch.f("ix_audit_events_principal_name"), ["principal_name"], unique=False)
        batch.create_index(batch.f("ix_audit_events_job_id"), ["job_id"], unique=False)
        batch.create_index(batch.f("ix_audit_events_tenant"), ["tenant"], unique=False)


def downgrade() -> None:
    op.drop_table("audit_events")
