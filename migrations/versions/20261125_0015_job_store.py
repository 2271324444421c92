"""a job's store: its URL and what the store agent last reported

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25 18:00:00

`jobs.store` is the URL given with `job submit --store` (or `store:` in a job file, or
RLFLEET_STORE): where the job's checkpoints and final outputs go. `jobs.store_status` is the
latest attempt's report of them, read by the poller. Both NULL for every existing job.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("store", sa.Text(), nullable=True))
    op.add_column(
        "jobs", sa.Column("store_status", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("jobs", "store_status")
    op.drop_column("jobs", "store")
