"""Tenant quotas: one row per tenant that has one (nominal GPUs per type, cache and remote IO
ceilings, borrowing and lending limits; services/metadata/store/quotas.py). Tenants without a
row have no quota, which is what every tenant of an upgraded cluster starts with.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_quotas",
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("quota", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant"], ["tenants.name"], name=op.f("fk_tenant_quotas_tenant_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant", name=op.f("pk_tenant_quotas")),
    )


def downgrade() -> None:
    op.drop_table("tenant_quotas")
