"""Datasets belong to a tenant (services/metadata/store/datasets.py): a ``tenant`` column, and a
``shared`` flag for the datasets every tenant may read.

Datasets registered before this revision had no owner, and every job of an upgraded cluster may
name them: they become tenant ``default``'s and shared, so those jobs keep reading them, and only
an admin (the old cluster token is one) may replace them.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 03:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN, not a batch (which on SQLite copies the table and drops the old one: with
    # foreign keys on, that drop would delete every manifest through dataset_objects' ON DELETE CASCADE).
    op.add_column("datasets", sa.Column("tenant", sa.String(length=128), nullable=False, server_default="default"))
    op.add_column("datasets", sa.Column("shared", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_index(op.f("ix_datasets_tenant"), "datasets", ["tenant"], unique=False)
    datasets = sa.table("datasets", sa.column("shared", sa.Boolean))
    op.get_bind().execute(datasets.update().values(shared=True))  # the rows of before: every tenant's


def downgrade() -> None:
    op.drop_index(op.f("ix_datasets_tenant"), table_name="datasets")
    op.drop_column("datasets", "shared")  # ALTER TABLE DROP COLUMN (SQLite 3.35+), for the reason above
    op.drop_column("datasets", "tenant")
