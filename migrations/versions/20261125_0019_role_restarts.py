"""role restarts: how many restarts in place of each role the poller has recorded

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-25 18:00:00

A job group's role with `restart: on-failure` is restarted in place by its VM's supervisor,
which counts the restarts in the attempt's `roles.json`. The poller reads that file with
every probe and records each new restart as an event; `job_nodes.role_restarts` (per rank:
{role: restarts recorded}) is what it has recorded so far, so that a restart is recorded
once, and what `job show` lists when the VM cannot be asked.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "job_nodes",
        sa.Column(
            "role_restarts",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default="{}",
            nullable=False,
        ),
    )


def downgrade() -> None:
    op.drop_column("job_nodes", "role_restarts")
