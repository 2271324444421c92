"""job row checks: what the dispatcher relies on when it launches a job

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Literal copies of scheduler/models.py at this revision: a migration never changes with
# the code that comes after it.
CHECKS = {
    "extra_args_strings": (
        "jsonb_typeof(extra_args) = 'array' AND "
        "NOT jsonb_path_exists(extra_args, '$[*] ? (@.type() != \"string\")')"
    ),
    "status_known": (
        "status IN ('queued', 'pending', 'starting', 'running', 'completed', 'failed', 'cancelled')"
    ),
    "gpus_sane": "gpus_requested <= 1024",
    "counts_sane": "max_retries <= 1000 AND retry_count >= 0 AND attempt >= 0",
    "spec_nonempty": "model <> '' AND dataset <> '' AND reward_function <> ''",
}


def upgrade() -> None:
    for name, condition in CHECKS.items():
        op.create_check_constraint(name, "jobs", condition)


def downgrade() -> None:
    for name in reversed(CHECKS):
        op.drop_constraint(name, "jobs", type_="check")
