"""Plans kept as changes: plans.base_version, set where the row holds only what the plan changes
of version base_version (CommitPlanRequest.changes); NULL where it holds the whole plan.

Existing plans are whole (NULL).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 06:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("base_version", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Whole plans cannot be rebuilt here without the store's code: a downgrade of a store holding
    # changes would leave plans an older silod reads wrong, so it is refused.
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT COUNT(*) FROM plans WHERE base_version IS NOT NULL")).scalar():
        raise RuntimeError("plans are stored as changes (revision 0009): remove them with retention or "
                           "start from an empty plans table before downgrading")
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("base_version")
