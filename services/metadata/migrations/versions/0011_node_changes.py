"""Node changes: nodes.changed_seq and the change_counts row "nodes", so that a scheduler lists
only the nodes that changed since its last listing (ListNodesRequest.changed_after) instead of
every node every round.

Existing nodes start at 0: only whole listings (changed_after 0) answer them, and every follower
starts from one.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 23:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    counts = op.create_table(
        "change_counts",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_change_counts")),
    )
    op.bulk_insert(counts, [{"name": "nodes", "value": 0}])
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("changed_seq", sa.BigInteger(), nullable=False, server_default="0"))
        batch.create_index(batch.f("ix_nodes_changed_seq"), ["changed_seq"])


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_index(batch.f("ix_nodes_changed_seq"))
        batch.drop_column("changed_seq")
    op.drop_table("change_counts")
