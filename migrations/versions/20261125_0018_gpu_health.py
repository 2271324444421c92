"""gpu health: a GPU's health reason, its clearing count, its ECC baseline, a hand drain,
and the events of its health

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-25 18:00:00

The poller reads each GPU's uncorrected ECC count, pending page retirement and row
remapping and the faults nvidia-smi prints (`scheduler.gpu_health`). A GPU keeps why it is
unhealthy (`health_reason`), how many polls in a row its condition has been clear
(`health_clear_polls`), the ECC count it had while healthy (`ecc_uncorrected`), and whether
an operator took it out by hand (`drained`). Each change is a row of `gpu_events`.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("gpus", sa.Column("health_reason", sa.Text(), nullable=True))
    op.add_column(
        "gpus",
        sa.Column("health_clear_polls", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("gpus", sa.Column("ecc_uncorrected", sa.BigInteger(), nullable=True))
    op.add_column("gpus", sa.Column("health_changed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "gpus", sa.Column("drained", sa.Boolean(), server_default=sa.text("false"), nullable=False)
    )
    op.create_table(
        "gpu_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("vm_id", sa.Integer(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=96), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["vm_id"], ["vms.id"], name=op.f("fk_gpu_events_vm_id_vms"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_events")),
    )
    op.create_index(op.f("ix_gpu_events_vm_id_created_at"), "gpu_events", ["vm_id", "created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_gpu_events_vm_id_created_at"), table_name="gpu_events")
    op.drop_table("gpu_events")
    op.drop_column("gpus", "drained")
    op.drop_column("gpus", "health_changed_at")
    op.drop_column("gpus", "ecc_uncorrected")
    op.drop_column("gpus", "health_clear_polls")
    op.drop_column("gpus", "health_reason")
