"""event counts: a waiting job's repeated event is one row with a count and a last time

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 15:00:00

A job waiting for GPUs goes queued → pending → queued about twice a minute, with the same
reasons. Instead of a row each time (21,000 a week), the first row of a reason in the
current waiting spell counts the repeats (`count`) and says when the last was (`last_at`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "job_events",
        sa.Column("count", sa.Integer(), server_default=sa.text("1"), nullable=False),
    )
    op.add_column("job_events", sa.Column("last_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(op.f("ck_job_events_count_positive"), "job_events", "count >= 1")


def downgrade() -> None:
    op.drop_constraint(op.f("ck_job_events_count_positive"), "job_events", type_="check")
    op.drop_column("job_events", "last_at")
    op.drop_column("job_events", "count")
