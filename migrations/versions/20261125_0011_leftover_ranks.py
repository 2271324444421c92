"""leftover ranks: which rank of its attempt a leftover is, and how it is known to have ended

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 15:00:00

An attempt given up for lost may turn out to have succeeded (late success). Whether it did
is one rule over its ranks (`scheduler.attempts.outcome`), but a newer attempt's claim
replaces the old attempt's `job_nodes` rows. The ledger row of each rank therefore keeps
its `rank` and the `exit_code` it is known to have ended with (copied from `job_nodes` when
the attempt is abandoned, or found by the kill). NULL: an attempt on one VM, a row written
before this revision, or not known to have exited.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("stale_processes", sa.Column("rank", sa.Integer(), nullable=True))
    op.add_column("stale_processes", sa.Column("exit_code", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("stale_processes", "exit_code")
    op.drop_column("stale_processes", "rank")
