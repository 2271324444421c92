"""job groups: the validated job spec file of a job (`jobs.roles`)

Revision ID: 0010
Revises: 0008
Create Date: 2026-11-22 23:00:00

Jobs submitted with flags have no spec file: `roles` is NULL for every existing job.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("roles", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.create_check_constraint(
        "roles_array", "jobs", "roles IS NULL OR jsonb_typeof(roles) = 'array'"
    )


def downgrade() -> None:
    # The job rows keep what the launch uses (model, dataset, rewards, GPUs, arguments).
    op.drop_constraint("roles_array", "jobs", type_="check")
    op.drop_column("jobs", "roles")
