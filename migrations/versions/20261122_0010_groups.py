"""groups: a job's roles (job groups) and the ports their roles were given

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-22 23:30:00

A job group keeps its validated roles in `jobs.roles` (the spec file's shape, without env
values, which stay in `jobs.env`); `job_ports` records the port each role's named port got
on its VM for the current attempt, unique per VM.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("roles", postgresql.JSONB(), nullable=True))
    op.create_table(
        "job_ports",
        sa.Column("vm_id", sa.Integer(), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.CheckConstraint("port BETWEEN 1 AND 65535", name=op.f("ck_job_ports_port_range")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_ports_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["vm_id"], ["vms.id"], name=op.f("fk_job_ports_vm_id_vms"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("vm_id", "port", name=op.f("pk_job_ports")),
    )
    op.create_index(op.f("ix_job_ports_job_id"), "job_ports", ["job_id"], unique=False)


def downgrade() -> None:
    # A group's roles cannot be described by 0009's schema: its row keeps the display fields.
    op.drop_index(op.f("ix_job_ports_job_id"), table_name="job_ports")
    op.drop_table("job_ports")
    op.drop_column("jobs", "roles")
