"""installation identity, launch tokens and recorded attempt directories

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 09:00:00.000000

Each database gets its own installation UUID, drawn here, at `rlfleet db upgrade` time
(a new database gets a new one). Jobs and leftover records get the launch token and the
recorded directory of their attempt. Rows of attempts launched before this revision get a
random token: their old directories (`~/.rlfleet/jobs/<id>/<attempt>/`) are never looked
at again, so upgrade with no job running (see CHANGELOG).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TOKEN_CHECK = "launch_token ~ '^[0-9a-f]{16}$'"
ATTEMPT_DIR_CHECK = "attempt_dir LIKE '/%'"
RANDOM_TOKEN = "substr(md5(random()::text || clock_timestamp()::text || id::text), 1, 16)"


def upgrade() -> None:
    op.create_table(
        "installation",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("singleton", sa.Boolean(), server_default="true", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("singleton", name=op.f("ck_installation_one_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
        sa.UniqueConstraint("singleton", name=op.f("uq_installation_singleton")),
    )
    op.execute(
        sa.text("INSERT INTO installation (id) VALUES (CAST(:id AS uuid))").bindparams(
            sa.bindparam("id", str(uuid.uuid4()))
        )
    )
    for table in ("jobs", "stale_processes"):
        op.add_column(table, sa.Column("launch_token", sa.String(length=16), nullable=True))
        op.add_column(table, sa.Column("attempt_dir", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("completed_attempt", sa.Integer(), nullable=True))
    op.execute(f"UPDATE jobs SET launch_token = {RANDOM_TOKEN} WHERE attempt >= 1")
    op.execute(f"UPDATE stale_processes SET launch_token = {RANDOM_TOKEN}")
    for table in ("jobs", "stale_processes"):
        op.create_check_constraint(op.f(f"ck_{table}_launch_token_hex"), table, TOKEN_CHECK)
        op.create_check_constraint(
            op.f(f"ck_{table}_attempt_dir_absolute"), table, ATTEMPT_DIR_CHECK
        )


def downgrade() -> None:
    for table in ("jobs", "stale_processes"):
        op.drop_constraint(op.f(f"ck_{table}_attempt_dir_absolute"), table, type_="check")
        op.drop_constraint(op.f(f"ck_{table}_launch_token_hex"), table, type_="check")
        op.drop_column(table, "attempt_dir")
        op.drop_column(table, "launch_token")
    op.drop_column("jobs", "completed_attempt")
    op.drop_table("installation")
