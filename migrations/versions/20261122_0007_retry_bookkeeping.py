"""retry bookkeeping: the retry decision and the count of machine faults in columns

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 21:00:00

Until now a failed job's decision was read from `next_attempt_at IS NULL` and a
`status_reason` starting with "gave up", and its machine faults were counted from the
reasons of its `job_events`; rewording a message changed behaviour. The upgrade fills both
columns from exactly those sources, so no job's fate changes across it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHECK = "retry_bookkeeping"
MACHINE_FAULT_EVENTS = ("node_lost%", "vm_removed%", "launch_failed: exit 12%")
"""How the reasons of machine-fault failures began in `job_events` (retry.py of 0006)."""


def upgrade() -> None:
    op.add_column("jobs", sa.Column("retry_decision", sa.String(length=16), nullable=True))
    op.add_column(
        "jobs", sa.Column("machine_faults", sa.Integer(), server_default="0", nullable=False)
    )
    op.execute(
        """
        UPDATE jobs SET retry_decision = CASE
            WHEN next_attempt_at IS NOT NULL THEN 'retry'
            WHEN status_reason LIKE 'gave up%' THEN 'give_up'
        END
        WHERE status = 'failed'
        """
    )
    like = " OR ".join(f"e.reason LIKE '{prefix}'" for prefix in MACHINE_FAULT_EVENTS)
    op.execute(
        f"""
        UPDATE jobs SET machine_faults = c.n FROM (
            SELECT e.job_id, count(*) AS n FROM job_events e
            WHERE e.to_status = 'failed' AND ({like})
            GROUP BY e.job_id
        ) c
        WHERE jobs.id = c.job_id
        """
    )
    op.create_check_constraint(
        CHECK,
        "jobs",
        "retry_decision IN ('retry', 'give_up') AND machine_faults >= 0",
    )


def downgrade() -> None:
    # 0006 reads a decision from next_attempt_at and status_reason, and the faults from the
    # events, which all stay as they are: nothing to write back.
    op.drop_constraint(CHECK, "jobs", type_="check")
    op.drop_column("jobs", "machine_faults")
    op.drop_column("jobs", "retry_decision")
