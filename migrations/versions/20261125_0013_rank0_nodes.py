"""rank 0 in job_nodes: every claimed attempt has its rows there, single-node jobs included

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 16:00:00

Until now rank 0 of an attempt lived on the job row only, and `job_nodes` held the other
ranks of multi-node jobs. From now on every claim writes one `job_nodes` row per VM, rank 0
included, and the poller, the leftover ledger and cancel read the ranks there alone. This
backfills a rank 0 row, from the job row, for every live single-node attempt that has none
(`starting` or `running`, placed on a VM, attempt >= 1): without it such an attempt would no
longer be probed after the upgrade. The leftover ledger's rows of single-node jobs that name
no rank get rank 0, as the rows written from now on do.

Downgrade leaves the rows and ranks: the code before this revision reads `job_nodes`
only for jobs of several nodes (a rank 0 row of those was always there) and reads the
ledger's rank only when it is set, so they are harmless to it; the next claim of a job
replaces its rows. Nothing that was there before the upgrade is deleted.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BACKFILL_SQL = """
INSERT INTO job_nodes (job_id, rank, attempt, vm_id, gpu_indices, gpu_uuids,
                       remote_pid, attempt_dir, exit_code)
SELECT j.id, 0, j.attempt, j.vm_id, coalesce(j.gpu_indices, '{}'),
       coalesce(j.gpu_uuids, '{}'), j.remote_pid, j.attempt_dir, NULL
FROM jobs j
WHERE j.status IN ('starting', 'running') AND j.vm_id IS NOT NULL AND j.attempt >= 1
  AND NOT EXISTS (SELECT 1 FROM job_nodes n WHERE n.job_id = j.id AND n.rank = 0)
ON CONFLICT (job_id, rank) DO NOTHING
"""

LEDGER_RANKS_SQL = """
UPDATE stale_processes s SET rank = 0
FROM jobs j
WHERE s.job_id = j.id AND s.rank IS NULL AND j.nodes = 1
"""


def upgrade() -> None:
    op.execute(sa.text(BACKFILL_SQL))
    # A single-node attempt's leftover is its rank 0: late success reads the ledger's rank
    # and exit code of every kind of attempt alike (`leftovers._ranks_succeeded`).
    op.execute(sa.text(LEDGER_RANKS_SQL))


def downgrade() -> None:
    """Nothing to undo: the backfilled rows are harmless to the code of revision 0012."""
