"""The claim of a single-node job: one statement (`CLAIM_SQL`) picks the best-fitting VM,
takes its GPU rows with `FOR UPDATE SKIP LOCKED` and moves the job `queued → starting` with a
lease, its `job_nodes` row and its event; a job that fits nowhere moves `queued → pending`
with the reason. A batch plans a shortlist of VMs first (`batch_shortlist`), so that each
claim looks at a few VMs' rows; a claim that misses there falls back to the whole fleet,
which alone decides pending and contended."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from scheduler import jobstore
from scheduler.attempts.shape import JobShape
from scheduler.claims.result import Claim, NoClaim, job_env_pairs
from scheduler.claims.why import park, waiting_reason
from scheduler.gpus import FREE_BY_VM_SQL, FREE_GPU, LEFTOVER_GPUS, USABLE_VM
from scheduler.jobs import move_event_sql, move_set_sql
from scheduler.placement import shortlist, tie_break_sql
from scheduler.remote.layout import ROOT, new_token
from scheduler.states import JobStatus

CANDIDATE_VMS = 4
"""How many best-fitting VMs one claim statement tries; more than one so that a VM whose
free GPUs another dispatcher holds locked right now does not make the claim miss."""

# `transition(queued → starting)` fused into the claim, rendered from the move's one
# definition (`jobs.move_values`): the same SET list and event row, in the same statement as
# the GPU rows, so a claim is one round trip. clock_timestamp(), not now(): in a batch, now()
# is when the transaction began, which can be before the GPU's previous job was released.
_CLAIM_MOVE = move_set_sql(JobStatus.QUEUED, JobStatus.STARTING, clock="clock_timestamp()")
_CLAIM_EVENT = move_event_sql(
    JobStatus.QUEUED,
    JobStatus.STARTING,
    rows="moved",
    job_id=":job_id",
    reason="'claimed GPUs ' || array_to_string(gpu_indices, ',')",
    actor=":actor",
    attempt="attempt",
)
_CLAIM_TEMPLATE = f"""
WITH {LEFTOVER_GPUS}, cand AS (
    SELECT g.vm_id, count(*) AS free
    FROM gpus g JOIN vms v ON v.id = g.vm_id
    WHERE {USABLE_VM} AND {FREE_GPU} {{only_vms}}
    GROUP BY g.vm_id
), fit AS (
    -- Best fit: the fullest VM that still fits. Ties are broken per job, so that
    -- concurrent claimers spread over equally full VMs instead of queueing on one.
    SELECT vm_id, free FROM cand WHERE free >= :need
    ORDER BY free, {tie_break_sql("vm_id", ":job_id")} LIMIT :candidates
), locked AS MATERIALIZED (
    -- Lock at most `need` free rows per candidate VM; rows another claimer holds are
    -- skipped, never waited for.
    SELECT f.vm_id, l.id, l.index, l.uuid FROM fit f CROSS JOIN LATERAL (
        SELECT g.id, g.index, g.uuid FROM gpus g
        WHERE g.vm_id = f.vm_id AND {FREE_GPU}
        ORDER BY g.index LIMIT :need
        FOR UPDATE OF g SKIP LOCKED
    ) l
), chosen_vm AS (
    SELECT l.vm_id FROM locked l JOIN fit f ON f.vm_id = l.vm_id
    GROUP BY l.vm_id, f.free HAVING count(*) >= :need
    ORDER BY f.free, {tie_break_sql("l.vm_id", ":job_id")} LIMIT 1
), chosen AS (
    SELECT l.id, l.index, l.uuid FROM locked l WHERE l.vm_id = (SELECT vm_id FROM chosen_vm)
    ORDER BY l.index LIMIT :need
), taken AS (
    -- clock_timestamp(), not now(): in a batch, now() is when the transaction began, which
    -- can be before the GPU's previous job was released and finished.
    UPDATE gpus SET job_id = :job_id, allocated_at = clock_timestamp(),
                    updated_at = clock_timestamp()
    FROM chosen WHERE gpus.id = chosen.id
    RETURNING gpus.index
), moved AS (
    -- `transition(queued → starting)`: the same guarded UPDATE (see _CLAIM_MOVE).
    UPDATE jobs SET {_CLAIM_MOVE},
        attempt = attempt + 1,
        vm_id = (SELECT vm_id FROM chosen_vm),
        gpu_indices = (SELECT array_agg(index ORDER BY index) FROM chosen),
        gpu_uuids = (SELECT array_agg(uuid ORDER BY index) FROM chosen),
        -- remote.layout.default_output_dir(installation, job_id)
        output_dir = coalesce(output_dir, '~/' || :root || '/'
                              || (SELECT CAST(id AS text) FROM installation) || '/outputs/'
                              || CAST(:job_id AS text)),
        lease_expires_at = clock_timestamp()
            + make_interval(secs => CAST(:lease_s AS double precision)),
        launch_token = :token, attempt_dir = NULL, completed_attempt = NULL,
        status_reason = NULL, failure_reason = NULL, exit_code = NULL, remote_pid = NULL
    WHERE id = :job_id AND status = 'queued' AND EXISTS (SELECT 1 FROM chosen_vm)
        AND EXISTS (SELECT 1 FROM installation)
    RETURNING attempt, vm_id, gpu_indices, gpu_uuids, output_dir, launch_token
), node AS (
    -- The attempt's one node (rank 0) in `job_nodes`, as every claimed attempt has: the
    -- row of an earlier attempt is replaced, those of its other ranks go.
    INSERT INTO job_nodes (job_id, rank, attempt, vm_id, gpu_indices, gpu_uuids)
    SELECT :job_id, 0, attempt, vm_id, gpu_indices, gpu_uuids FROM moved
    ON CONFLICT (job_id, rank) DO UPDATE SET
        attempt = excluded.attempt, vm_id = excluded.vm_id,
        gpu_indices = excluded.gpu_indices, gpu_uuids = excluded.gpu_uuids,
        remote_pid = NULL, attempt_dir = NULL, exit_code = NULL
), other_nodes AS (
    DELETE FROM job_nodes WHERE job_id = :job_id AND rank > 0 AND EXISTS (SELECT 1 FROM moved)
), event AS (
    {_CLAIM_EVENT}
)
SELECT m.vm_id, m.gpu_indices, m.gpu_uuids, m.attempt, m.output_dir, m.launch_token,
       (SELECT CAST(id AS text) FROM installation) AS installation,
       (SELECT coalesce(max(free), 0) FROM cand) AS largest_free
FROM (SELECT 1) one LEFT JOIN moved m ON true
"""
CLAIM_SQL = text(_CLAIM_TEMPLATE.format(only_vms=""))
CLAIM_SHORTLIST_SQL = text(_CLAIM_TEMPLATE.format(only_vms="AND g.vm_id = ANY(:vm_ids)"))
"""CLAIM_SQL among the VMs a batch's plan named: an index scan of a few VMs' GPU rows
instead of counting every free GPU of the fleet again for every job."""

LARGEST_VM_SQL = text(jobstore.LARGEST_VM_SQL)
"""`jobstore.LARGEST_VM_SQL`: the most GPUs any one VM has, whatever its state."""


async def batch_shortlist(conn: AsyncConnection, rows: Sequence[Any], candidates: int) -> list[int]:
    """The VMs a batch's claims look at first (`placement.shortlist` over one count of the
    free GPUs)."""
    free = (await conn.execute(FREE_BY_VM_SQL)).all()
    return shortlist(
        ((vm_id, n) for vm_id, n in free),
        ((row.id, row.gpus_requested) for row in rows),
        candidates,
    )


async def claim_one(
    conn: AsyncConnection,
    row: Any,
    actor: str,
    lease_s: float,
    candidates: int,
    shortlist: list[int] | None,
) -> Claim | NoClaim:
    """Claim (or park as pending) one queued, locked job: the CLAIM statement (on the
    shortlist first, when there is one), then maybe the pending move."""
    job_id, need = row.id, row.gpus_requested
    params = {
        "job_id": job_id,
        "need": need,
        "candidates": candidates,
        "root": ROOT,
        "token": new_token(),
        "lease_s": lease_s,
        "actor": actor,
    }
    result = None
    if shortlist:
        result = (await conn.execute(CLAIM_SHORTLIST_SQL, {**params, "vm_ids": shortlist})).one()
    if result is None or result.vm_id is None:
        # Pending and contended are only ever decided on the whole fleet.
        result = (await conn.execute(CLAIM_SQL, params)).one()
    if result.vm_id is not None:
        return Claim(
            job_id,
            result.attempt,
            result.vm_id,
            list(result.gpu_indices),
            result.output_dir,
            model=row.model,
            dataset=row.dataset,
            reward_functions=tuple(r for r in row.reward_function.split(",") if r),
            extra_args=tuple(str(a) for a in row.extra_args or ()),
            gpu_uuids=tuple(result.gpu_uuids or ()),
            installation=result.installation,
            token=result.launch_token,
            env=job_env_pairs(row.env),
            workdir=row.workdir_digest,
            store=row.store,
            roles=row.roles,
            shape=JobShape.of_row(row),
        )
    if result.largest_free >= need:
        # Free GPUs exist but other claimers hold them: not a reason to wait.
        return NoClaim(job_id, row.status, "contended", contended=True)
    return await park(conn, job_id, await waiting_reason(conn, [need]), actor)
