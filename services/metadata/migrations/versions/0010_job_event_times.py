"""An index on job_events.time: a scheduler reads only the jobs whose state changed since its last
read (ListJobsRequest.state_changed_since, answered from the "state" events that creation and
every state move write) instead of every active job every round.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 06:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_job_events_time", "job_events", ["time"])


def downgrade() -> None:
    op.drop_index("ix_job_events_time", table_name="job_events")
