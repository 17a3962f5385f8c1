"""Identities and access: tenants, their members (user names) and hashed bearer credentials.

Every tenant that existing jobs name becomes a tenant row (no members yet), so an upgraded
cluster's admin adds members to the teams it already has instead of recreating them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-28 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

from services.metadata.models import UtcDateTime

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenants")),
    )
    op.create_table(
        "tenant_members",
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("user", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(["tenant"], ["tenants.name"], name=op.f("fk_tenant_members_tenant_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant", "user", name=op.f("pk_tenant_members")),
    )
    with op.batch_alter_table("tenant_members") as batch:
        batch.create_index(batch.f("ix_tenant_members_user"), ["user"], unique=False)
    op.create_table(
        "credentials",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_credentials")),
    )
    with op.batch_alter_table("credentials") as batch:
        batch.create_index(batch.f("ix_credentials_name"), ["name"], unique=False)

    connection = op.get_bind()
    existing = connection.execute(sa.text("SELECT DISTINCT tenant FROM jobs WHERE tenant <> ''")).scalars().all()
    if existing:
        # UtcDateTime so the value is stored as the models store it (naive UTC text on SQLite).
        rows = sa.table("tenants", sa.column("name", sa.String), sa.column("created_at", UtcDateTime()))
        now = datetime.now(timezone.utc)
        op.bulk_insert(rows, [{"name": name, "created_at": now} for name in sorted(existing)])


def downgrade() -> None:
    op.drop_table("credentials")
    op.drop_table("tenant_members")
    op.drop_table("tenants")
