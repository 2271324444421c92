"""workdirs: a job's code and data, packed and stored once per content

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-25 18:00:00

`job submit --workdir DIR` packs DIR into a gzip'd tar kept in `workdirs`, keyed by the
sha256 of its bytes; `jobs.workdir_digest` names the workdir a job runs in.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workdirs",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("digest ~ '^[0-9a-f]{64}$'", name=op.f("ck_workdirs_digest_hex")),
        sa.CheckConstraint(
            "size = octet_length(data) AND files >= 0", name=op.f("ck_workdirs_size_sane")
        ),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_workdirs")),
    )
    op.add_column("jobs", sa.Column("workdir_digest", sa.String(length=64), nullable=True))
    op.create_foreign_key(
        op.f("fk_jobs_workdir_digest_workdirs"),
        "jobs",
        "workdirs",
        ["workdir_digest"],
        ["digest"],
        ondelete="RESTRICT",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("fk_jobs_workdir_digest_workdirs"), "jobs", type_="foreignkey")
    op.drop_column("jobs", "workdir_digest")
    op.drop_table("workdirs")
