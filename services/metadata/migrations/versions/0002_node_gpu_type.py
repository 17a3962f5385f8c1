"""GPU types: nodes.gpu_type, so that nodes can be listed and placed by the type of their GPUs.

Existing nodes take the type from their stored spec (empty before this change: untyped).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25 05:05:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("gpu_type", sa.String(length=32), nullable=False, server_default=""))
        batch.create_index(batch.f("ix_nodes_gpu_type"), ["gpu_type"], unique=False)
    nodes = sa.table("nodes", sa.column("name", sa.String), sa.column("spec", sa.JSON),
                     sa.column("gpu_type", sa.String))
    connection = op.get_bind()
    for name, spec in connection.execute(sa.select(nodes.c.name, nodes.c.spec)).all():
        gpu_type = (spec or {}).get("gpu_type", "") if isinstance(spec, dict) else ""
        if gpu_type:
            connection.execute(nodes.update().where(nodes.c.name == name).values(gpu_type=gpu_type))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_index(batch.f("ix_nodes_gpu_type"))
        batch.drop_column("gpu_type")
