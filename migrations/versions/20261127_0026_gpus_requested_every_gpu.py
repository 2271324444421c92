"""gpus_requested: every GPU an attempt holds, for every kind of job

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27 19:00:00

`jobs.gpus_requested` meant GPUs on each VM for a training job and every GPU for a job
group. It now means every GPU an attempt holds, all its VMs together, for every kind: a
training job's (`roles` SQL NULL or JSON null) becomes `gpus_requested * nodes`, and the
bound of `ck_jobs_gpus_sane` becomes 1024 GPUs on each of 64 VMs. `attempts.shape.JobShape`
reads a training job's GPUs on each VM back as `gpus_requested / nodes`.

The downgrade divides again; a row the old bound cannot hold (a group of more than 1024
GPUs, or a total that was never the same on each VM) is bounded to what it allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Literal copies of the code at this revision: a migration never changes with the code
# that comes after it.
TRAINING = "coalesce(jsonb_typeof(roles), 'null') = 'null'"
"""A training job's row: no roles (SQL NULL, or a JSON null written by hand)."""
OLD_SANE = "gpus_requested <= 1024"
NEW_SANE = "gpus_requested <= 65536"


def upgrade() -> None:
    op.drop_constraint(op.f("ck_jobs_gpus_sane"), "jobs", type_="check")
    op.execute(f"UPDATE jobs SET gpus_requested = gpus_requested * nodes WHERE {TRAINING}")
    op.create_check_constraint("gpus_sane", "jobs", NEW_SANE)


def downgrade() -> None:
    op.drop_constraint(op.f("ck_jobs_gpus_sane"), "jobs", type_="check")
    op.execute(
        "UPDATE jobs SET gpus_requested = LEAST(1024, GREATEST(1, gpus_requested / nodes)) "
        f"WHERE {TRAINING}"
    )
    op.execute(f"UPDATE jobs SET gpus_requested = 1024 WHERE NOT ({OLD_SANE})")
    op.create_check_constraint("gpus_sane", "jobs", OLD_SANE)
