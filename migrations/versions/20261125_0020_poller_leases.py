"""pollers share the fleet: a row per live poller, and which poller holds each VM

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-25 18:00:00

Several pollers divide the VMs between them with Postgres as the only coordinator
(`scheduler.gpu_poller.shares`). `pollers` has a row per running poller, renewed every
fraction of the poller lease; a row whose lease ran out is deleted by whichever poller
sees it first, and a VM whose `poller_id` names no row is free for the others to take.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pollers",
        sa.Column("id", sa.Integer(), sa.Identity(always=False), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("lease_s", sa.Double(), nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "renewed_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("lease_s > 0 AND lease_s <= 3600", name=op.f("ck_pollers_lease_range")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pollers")),
    )
    # No foreign key: its checks would lock poller rows from every sweep's writes (a
    # poller_id that names no row means the VM is free).
    op.add_column("vms", sa.Column("poller_id", sa.Integer(), nullable=True))
    op.create_index(op.f("ix_vms_poller_id"), "vms", ["poller_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_vms_poller_id"), table_name="vms")
    op.drop_column("vms", "poller_id")
    op.drop_table("pollers")
