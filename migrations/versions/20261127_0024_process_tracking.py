"""process tracking: how each VM tracks the processes of an attempt

Revision ID: 0024
Revises: 0020
Create Date: 2026-11-27 16:00:00

`vms.process_tracking` is what the poller's probe last found (`remote.cgroup`): a cgroup
v2 per attempt (`cgroup v2 (<root>, cgroup.kill)` or `(…, freeze)`) or the environment
marker (`marker (<why>)`); NULL until a poll said. `vm show` and `vm list --json` show it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("vms", sa.Column("process_tracking", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("vms", "process_tracking")
