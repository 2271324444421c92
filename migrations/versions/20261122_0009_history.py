"""history: progress samples per training step and GPU samples per poll

Revision ID: 0009
Revises: 0007
Create Date: 2026-11-22 23:00:00

The web dashboard draws reward and loss curves over steps and GPU utilisation and memory
timelines; the poller records both as it polls, and prunes them after the retention
(`RLFLEET_HISTORY_DAYS`, 7 days by default).
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
    op.create_table(
        "progress_samples",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column(
            "recorded_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_progress_samples_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress_samples")),
        sa.UniqueConstraint(
            "job_id", "attempt", "step", name=op.f("uq_progress_samples_job_id_attempt_step")
        ),
    )
    op.create_index(
        "ix_progress_samples_recorded_at", "progress_samples", ["recorded_at"], unique=False
    )
    op.create_table(
        "gpu_samples",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("gpu_id", sa.Integer(), nullable=False),
        sa.Column("utilization_pct", sa.SmallInteger(), nullable=True),
        sa.Column("memory_used_mb", sa.Integer(), nullable=True),
        sa.Column("memory_total_mb", sa.Integer(), nullable=True),
        sa.Column(
            "recorded_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["gpu_id"], ["gpus.id"], name=op.f("fk_gpu_samples_gpu_id_gpus"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_samples")),
    )
    op.create_index(
        "ix_gpu_samples_gpu_id_recorded_at",
        "gpu_samples",
        ["gpu_id", "recorded_at"],
        unique=False,
    )
    op.create_index("ix_gpu_samples_recorded_at", "gpu_samples", ["recorded_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_gpu_samples_recorded_at", table_name="gpu_samples")
    op.drop_index("ix_gpu_samples_gpu_id_recorded_at", table_name="gpu_samples")
    op.drop_table("gpu_samples")
    op.drop_index("ix_progress_samples_recorded_at", table_name="progress_samples")
    op.drop_table("progress_samples")
