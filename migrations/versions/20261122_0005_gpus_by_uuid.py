"""GPUs keyed by UUID; jobs launched on UUIDs; VM launch errors and removal

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 19:50:00

A GPU row is identified by its UUID: nvidia-smi's index can change after a reboot or when
a card is removed, and a claim must stay on the card it took (docs/invariants.md,
invariant 8). Rows without a UUID cannot be matched to a card; no poller ever wrote one
(the parser refuses a line without it), so they are dropped and the next poll recreates
the VM's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("DELETE FROM gpus WHERE uuid IS NULL")
    op.alter_column("gpus", "uuid", existing_type=sa.String(length=96), nullable=False)
    op.drop_constraint(op.f("uq_gpus_vm_id_index"), "gpus", type_="unique")
    op.create_unique_constraint(op.f("uq_gpus_vm_id_uuid"), "gpus", ["vm_id", "uuid"])
    op.add_column("jobs", sa.Column("gpu_uuids", postgresql.ARRAY(sa.String(96)), nullable=True))
    op.add_column(
        "stale_processes",
        sa.Column("gpu_uuids", postgresql.ARRAY(sa.String(96)), nullable=True),
    )
    # Claims made before the upgrade: their UUIDs are the rows' UUIDs at those indices now.
    op.execute(
        """
        UPDATE jobs j SET gpu_uuids = (
            SELECT array_agg(g.uuid ORDER BY g.index) FROM gpus g
            WHERE g.vm_id = j.vm_id AND g.index = ANY(j.gpu_indices)
        ) WHERE j.gpu_indices IS NOT NULL AND j.vm_id IS NOT NULL
        """
    )
    op.execute(
        """
        UPDATE stale_processes s SET gpu_uuids = (
            SELECT array_agg(g.uuid ORDER BY g.index) FROM gpus g
            WHERE g.vm_id = s.vm_id AND g.index = ANY(s.gpu_indices)
        ) WHERE s.gpu_indices IS NOT NULL AND s.killed_at IS NULL
        """
    )
    op.add_column("vms", sa.Column("launch_error", sa.Text(), nullable=True))
    op.add_column(
        "vms", sa.Column("removing", sa.Boolean(), server_default="false", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("vms", "removing")
    op.drop_column("vms", "launch_error")
    op.drop_column("stale_processes", "gpu_uuids")
    op.drop_column("jobs", "gpu_uuids")
    op.drop_constraint(op.f("uq_gpus_vm_id_uuid"), "gpus", type_="unique")
    # Indices may repeat within a VM once rows are kept by UUID (a renumbered or absent
    # card): keep the newest row of each index so the old constraint holds again.
    op.execute(
        """
        DELETE FROM gpus g USING gpus newer
        WHERE g.vm_id = newer.vm_id AND g.index = newer.index
          AND (g.updated_at, g.id) < (newer.updated_at, newer.id)
        """
    )
    op.create_unique_constraint(op.f("uq_gpus_vm_id_index"), "gpus", ["vm_id", "index"])
    op.alter_column("gpus", "uuid", existing_type=sa.String(length=96), nullable=True)
