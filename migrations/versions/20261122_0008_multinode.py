"""multi-node jobs: jobs.nodes, vms.internal_address and the per-rank table job_nodes

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 22:00:00

Every existing job is a single-node job (`nodes = 1`), whose attempt the job row alone
describes; `job_nodes` starts empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("nodes", sa.Integer(), server_default="1", nullable=False))
    op.create_check_constraint("nodes_range", "jobs", "nodes BETWEEN 1 AND 64")
    op.add_column("vms", sa.Column("internal_address", sa.String(length=255), nullable=True))
    op.create_table(
        "job_nodes",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=True),
        sa.Column("gpu_indices", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("gpu_uuids", postgresql.ARRAY(sa.String(length=96)), nullable=False),
        sa.Column("remote_pid", sa.Integer(), nullable=True),
        sa.Column("attempt_dir", sa.Text(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.CheckConstraint("rank >= 0", name=op.f("ck_job_nodes_rank_nonnegative")),
        sa.CheckConstraint("attempt_dir LIKE '/%'", name=op.f("ck_job_nodes_attempt_dir_absolute")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_nodes_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["vm_id"], ["vms.id"], name=op.f("fk_job_nodes_vm_id_vms"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("job_id", "rank", name=op.f("pk_job_nodes")),
    )
    op.create_index(op.f("ix_job_nodes_vm_id"), "job_nodes", ["vm_id"], unique=False)


def downgrade() -> None:
    # Multi-node jobs cannot be described by 0007's schema: the job row keeps rank 0.
    op.drop_index(op.f("ix_job_nodes_vm_id"), table_name="job_nodes")
    op.drop_table("job_nodes")
    op.drop_column("vms", "internal_address")
    op.drop_constraint("nodes_range", "jobs", type_="check")
    op.drop_column("jobs", "nodes")
