"""Which GPUs are free, giving a job's GPUs back, and recounting a VM's free GPUs.

A GPU is free when the placement policy finds it eligible (`scheduler.placement`: healthy,
idle, not drained, on a VM that answers and is not draining), rlfleet has not given it to a
job, and no leftover (`scheduler.leftovers`: an
attempt that may still run on its VM) may still hold it. The claim query, the pending
planner and every recount use the SQL fragments here, so they all count alike.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import jobstore
from scheduler.db import Database
from scheduler.jobstore import colon_style
from scheduler.placement import ELIGIBLE_GPU_SQL, ELIGIBLE_VM_SQL

LEFTOVER_GPUS = """
    leftover_gpus AS MATERIALIZED (
        SELECT s.vm_id, u AS uuid, NULL::int AS index
        FROM leftovers s, unnest(s.gpu_uuids) u WHERE s.killed_at IS NULL
        UNION ALL
        SELECT s.vm_id, NULL, i FROM leftovers s, unnest(s.gpu_indices) i
        WHERE s.killed_at IS NULL AND s.gpu_uuids IS NULL
    )
"""
"""CTE `leftover_gpus`: the GPUs open leftover rows keep out of use (usually none: computed
once, then hash anti-joined). A leftover blocks its GPUs by UUID (a renumbering cannot
move them); rows written before UUIDs were recorded block by index."""

FREE_GPU = f"""
    g.job_id IS NULL AND {ELIGIBLE_GPU_SQL}
    AND NOT EXISTS (
        SELECT 1 FROM leftover_gpus b
        WHERE b.vm_id = g.vm_id AND (b.uuid = g.uuid OR b.index = g.index)
    )
"""
"""The condition on GPU row `g` (with `LEFTOVER_GPUS` in the WITH list) that it is free:
eligible by the placement policy (`placement.ELIGIBLE_GPU_SQL`), held by no job, and kept
out of use by no leftover."""

USABLE_VM = ELIGIBLE_VM_SQL
"""The condition on VM row `v` that its free GPUs may be claimed (`placement`)."""

FREE_BY_VM_SQL = text(
    f"""
WITH {LEFTOVER_GPUS}
SELECT g.vm_id, count(*) AS free FROM gpus g JOIN vms v ON v.id = g.vm_id
WHERE {USABLE_VM} AND {FREE_GPU} GROUP BY g.vm_id
"""
)

AVAILABLE_SQL = text(
    f"""
WITH {LEFTOVER_GPUS}, ordered AS MATERIALIZED (
    -- A recount never waits for a VM row another transaction holds: it skips it. Waiting
    -- could deadlock with a transaction that releases several jobs' GPUs (each release
    -- recounts its VMs, in job order); the skipped count is redone within the second by
    -- the dispatcher's and the poller's own recounts.
    SELECT id FROM vms WHERE id = ANY(:ids) ORDER BY id FOR UPDATE SKIP LOCKED
)
UPDATE vms v SET available_gpus = (
    SELECT count(*) FROM gpus g WHERE g.vm_id = v.id AND {FREE_GPU}
)
FROM ordered o WHERE v.id = o.id
"""
)

RECOUNT_SQL = text(
    f"""
WITH {LEFTOVER_GPUS}
UPDATE vms v SET available_gpus = (
    SELECT count(*) FROM gpus g WHERE g.vm_id = v.id AND {FREE_GPU}
)
WHERE v.id = ANY(:ids)
  -- A count that did not change is not written again (a row version per VM per poll).
  AND v.available_gpus IS DISTINCT FROM (
    SELECT count(*) FROM gpus g WHERE g.vm_id = v.id AND {FREE_GPU}
  )
"""
)
"""AVAILABLE_SQL that waits for the VM rows: for a transaction that holds them already (the
poller's, which has just written them), and that must not skip any."""


async def release_in_session(session: AsyncSession, job_id: int) -> list[int]:
    """Free every GPU allocated to `job_id` (caller's transaction); returns their indices."""
    rows = (
        await session.execute(
            text(
                "UPDATE gpus SET job_id = NULL, allocated_at = NULL, updated_at = now() "
                "WHERE job_id = :job_id RETURNING vm_id, index"
            ),
            {"job_id": job_id},
        )
    ).all()
    # A job group's ports go with its GPUs: the attempt that used them is over.
    await session.execute(text("DELETE FROM job_ports WHERE job_id = :job_id"), {"job_id": job_id})
    await refresh_available_in_session(session, {vm_id for vm_id, _index in rows})
    return sorted(index for _vm, index in rows)


async def refresh_available_in_session(session: AsyncSession, vm_ids: set[int]) -> None:
    """Recount `vms.available_gpus` of these VMs from their GPU rows (caller's transaction).

    Claims do not touch the `vms` row: every claim on a VM would queue on that one row lock
    until the previous commit. The count is refreshed after the fact instead (dispatcher,
    release, and every poll), so it is informational and never decides a claim.
    """
    if vm_ids:
        await session.execute(AVAILABLE_SQL, {"ids": sorted(vm_ids)})


async def refresh_available(db: Database, vm_ids: set[int]) -> None:
    """`refresh_available_in_session` in a short transaction of its own."""
    async with db.transaction() as session:
        await refresh_available_in_session(session, vm_ids)


LARGEST_VM_SQL = text(jobstore.LARGEST_VM_SQL)
"""`jobstore.LARGEST_VM_SQL`: the most GPUs any one VM has, whatever its state."""

VMS_WITH_SQL = text(colon_style(jobstore.VMS_WITH_SQL))
"""`jobstore.VMS_WITH_SQL`: how many VMs have at least `need` GPUs, whatever their state."""

VM_SIZES_SQL = text("SELECT count(*) FROM gpus GROUP BY vm_id")
"""The number of GPUs of each VM, whatever its state."""

# -- audits (tests, benchmarks, operators): each counts what must always be 0 ------------

_WHOLE = "j.gpus_requested"
"""Every GPU a job holds when claimed, all its VMs together, whatever its kind."""

PARTIAL_CLAIMS_SQL = text(
    f"""
SELECT count(*) FROM jobs j WHERE
  (SELECT count(*) FROM gpus g WHERE g.job_id = j.id) NOT IN (0, {_WHOLE})
  OR (j.status IN ('starting', 'running')
      AND (SELECT count(*) FROM gpus g WHERE g.job_id = j.id) <> {_WHOLE})
  OR ((SELECT count(DISTINCT g.vm_id) FROM gpus g WHERE g.job_id = j.id) NOT IN (0, j.nodes))
  OR (j.status IN ('starting', 'running') AND EXISTS (
      SELECT 1 FROM job_nodes n WHERE n.job_id = j.id AND n.attempt = j.attempt
        AND cardinality(n.gpu_indices) <> (SELECT count(*) FROM gpus g
                                           WHERE g.job_id = j.id AND g.vm_id = n.vm_id)))
"""
)
"""Jobs holding some but not all of their GPUs, live jobs holding fewer than they asked
for, a job on other than one VM per rank (a gang with two ranks on one VM), or a live job
whose rank holds other than its own GPUs on its VM (docs/invariants.md, invariant 1):
the same audit for every kind of job, each rank's GPUs being its `job_nodes` row's."""

_LIVE_HELD = """
SELECT j.id AS job_id, j.vm_id, i FROM jobs j, unnest(j.gpu_indices) i
WHERE j.status IN ('starting', 'running') AND j.nodes = 1
UNION ALL
SELECT j.id, n.vm_id, i FROM jobs j JOIN job_nodes n ON n.job_id = j.id AND n.attempt = j.attempt,
  unnest(n.gpu_indices) i
WHERE j.status IN ('starting', 'running') AND j.nodes > 1
"""

DOUBLE_BOOKED_SQL = text(
    f"""
SELECT
  (SELECT count(*) FROM (SELECT vm_id, i FROM ({_LIVE_HELD}) h
                         GROUP BY vm_id, i HAVING count(*) > 1) d)
  + (SELECT count(*) FROM ({_LIVE_HELD}) h WHERE NOT EXISTS (
       SELECT 1 FROM gpus g WHERE g.vm_id = h.vm_id AND g.index = h.i AND g.job_id = h.job_id))
"""
)
"""GPUs that two live jobs (or ranks) name at once, plus GPUs a live job or rank names
whose row is not held by it: double bookings, counted from the jobs' own records."""
