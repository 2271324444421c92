"""hang timeouts: a job's hang and startup timeouts, and the progress the poller last read

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-25 18:00:00

`jobs.hang_timeout_s` and `jobs.startup_timeout_s` (`job submit --hang-timeout`,
`--startup-timeout`; 0 turns a check off) and the poller's last reading of the current
attempt's progress: the step, the attempt it was read from, and when it was first read
(the database's clock), from which a running attempt that stopped advancing is found hung;
and `job_diagnostics`, what was captured of such an attempt before it was stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MAX_TIMEOUT_S = 7 * 86400


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("hang_timeout_s", sa.Integer(), server_default="1800", nullable=False)
    )
    op.add_column(
        "jobs",
        sa.Column("startup_timeout_s", sa.Integer(), server_default="3600", nullable=False),
    )
    op.add_column("jobs", sa.Column("progress_attempt", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("progress_step", sa.Integer(), nullable=True))
    op.add_column(
        "jobs", sa.Column("progress_changed_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.create_check_constraint(
        "liveness_timeouts",
        "jobs",
        f"hang_timeout_s BETWEEN 0 AND {MAX_TIMEOUT_S}"
        f" AND startup_timeout_s BETWEEN 0 AND {MAX_TIMEOUT_S}",
    )
    op.create_table(
        "job_diagnostics",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("vm_name", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column(
            "captured_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "attempt"),
    )


def downgrade() -> None:
    op.drop_table("job_diagnostics")
    op.drop_constraint("liveness_timeouts", "jobs", type_="check")
    for column in (
        "progress_changed_at",
        "progress_step",
        "progress_attempt",
        "startup_timeout_s",
        "hang_timeout_s",
    ):
        op.drop_column("jobs", column)
