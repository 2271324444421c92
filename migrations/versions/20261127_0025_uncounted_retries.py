"""uncounted retries: how many retries of each uncounted class a job has had

Revision ID: 0025
Revises: 0020
Create Date: 2026-11-27 15:30:00

`jobs.uncounted_retries`, a JSON object from failure reason (`store_error`, `node_lost`,
`gpu_failed`, `vm_removed`, `launch_failed`) to the retries after it that did not count
against `max_retries` (`requeue_steps.retries.requeue_due` adds one with each). The retry
policy caps their sum per job (`RetryPolicy.uncounted_limit`) and names them in the final
reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column(
            "uncounted_retries",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default="{}",
            nullable=False,
        ),
    )
    op.create_check_constraint(
        "uncounted_retries_object", "jobs", "jsonb_typeof(uncounted_retries) = 'object'"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_jobs_uncounted_retries_object"), "jobs", type_="check")
    op.drop_column("jobs", "uncounted_retries")
