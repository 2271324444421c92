"""vms.job_user: the Unix account a VM's jobs run as (`rlfleet vm add/set --job-user`)

Revision ID: 0023
Revises: 0020
Create Date: 2026-11-27 15:30:00

NULL: jobs run as the VM account the scheduler logs in as (one trust domain with the
scheduler on that VM, docs/security.md). A name: the scheduler's account starts each
attempt as that user through sudo (scheduler/remote/jobuser.py). The check mirrors
`scheduler.remote.jobuser.JOB_USER_RE`; the value is checked again when read.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("vms", sa.Column("job_user", sa.String(length=32), nullable=True))
    op.create_check_constraint(
        "job_user_name",
        "vms",
        "job_user IS NULL OR (job_user ~ '^[a-z_][a-z0-9_-]{0,31}$' AND job_user <> 'root')",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_vms_job_user_name"), "vms", type_="check")
    op.drop_column("vms", "job_user")
