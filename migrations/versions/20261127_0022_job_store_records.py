"""job_store_records: what each attempt's store agent reported writing to the job's store

Revision ID: 0022
Revises: 0020
Create Date: 2026-11-27 16:00:00

The digest (sha256 of the manifest's bytes) of every checkpoint manifest and final
marker an attempt wrote, as its store agent reported it through the poll
(`scheduler.store_records`, `scheduler.store.binding`). Restore, completion by a final
marker and `job pull` take only store content recorded here for the job: what another
job put in its place in a shared store is not (docs/invariants.md, invariant 12).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_store_records",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column(
            "recorded_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "kind IN ('checkpoint', 'final')", name=op.f("ck_job_store_records_kind")
        ),
        sa.CheckConstraint(
            "step >= 0 AND step <= 999999999 AND (kind = 'checkpoint' OR step = 0)",
            name=op.f("ck_job_store_records_step_range"),
        ),
        sa.CheckConstraint(
            "digest ~ '^[0-9a-f]{64}$'", name=op.f("ck_job_store_records_digest_hex")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_job_store_records_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_store_records")),
        sa.UniqueConstraint(
            "job_id",
            "kind",
            "step",
            "digest",
            name=op.f("uq_job_store_records_job_id_kind_step_digest"),
        ),
    )


def downgrade() -> None:
    op.drop_table("job_store_records")
