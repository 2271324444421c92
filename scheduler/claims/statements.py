"""The statements of a claim, for every kind of job (`scheduler.claims.claim`):

- `LOCK_SHORTLIST_SQL` locks, once for a batch, with `FOR UPDATE SKIP LOCKED`
  (docs/invariants.md, invariant 1: rows another claimer holds are skipped, never waited
  for), the free GPU rows the batch's shortlist names (`placement.shortlist`): an index
  scan of a few VMs' rows that every claim of the batch then assigns from;
- `LOCK_SQL`, for a claim that found no room there (or a batch of one), counts the free
  GPUs of every VM and locks candidate rows on the best-fitting VMs for each per-rank
  demand (`placement.lock_levels`), in the placement's VM and GPU orders
  (`placement.tie_break_sql`, `placement.gpu_order_sql`); the whole fleet's count decides
  `contended` and `pending`;
- `TAKE_SQL` gives the rows `placement.assign` picked to the job, moves it
  `queued → starting` with its event (rendered from the move's one definition,
  `jobs.move_set_sql` / `jobs.move_event_sql`) and writes every rank's `job_nodes` row,
  replacing the earlier attempt's rows: the one writer of where an attempt's ranks run.

A claim is thus one round trip (two when the shortlist had no room) whatever its kind,
beside one per batch; nothing in them waits for a lock.
"""

from __future__ import annotations

from sqlalchemy import text

from scheduler.gpus import FREE_GPU, LEFTOVER_GPUS, USABLE_VM
from scheduler.jobs import move_event_sql, move_set_sql
from scheduler.placement import gpu_order_sql, tie_break_sql
from scheduler.states import JobStatus

_LOCK_TEMPLATE = f"""
WITH {LEFTOVER_GPUS}, cand AS MATERIALIZED (
    SELECT g.vm_id, count(*) AS free
    FROM gpus g JOIN vms v ON v.id = g.vm_id
    WHERE {USABLE_VM} AND {FREE_GPU} {{only_vms}}
    GROUP BY g.vm_id
), fit AS (
    -- For each per-rank demand `need`: the `top` best-fitting VMs that have it free. A
    -- VM named for several demands has rows locked for the largest.
    SELECT c.vm_id, max(c.free) AS free, max(t.need) AS need
    FROM unnest(CAST(:needs AS integer[]), CAST(:tops AS integer[])) AS t(need, top)
    CROSS JOIN LATERAL (
        SELECT vm_id, free FROM cand WHERE free >= t.need
        ORDER BY free, {tie_break_sql("vm_id", ":job_id")} LIMIT t.top
    ) c
    GROUP BY c.vm_id
), locked AS MATERIALIZED (
    -- At most `need` free rows per candidate VM, in the placement's GPU order; rows
    -- another claimer holds are skipped, never waited for.
    SELECT f.vm_id, f.free, l.id, l.index, l.uuid FROM fit f CROSS JOIN LATERAL (
        SELECT g.id, g.index, g.uuid FROM gpus g
        WHERE g.vm_id = f.vm_id AND {FREE_GPU}
        ORDER BY {gpu_order_sql("g")} LIMIT f.need
        FOR UPDATE OF g SKIP LOCKED
    ) l
)
SELECT array_agg(vm_id) AS vms, array_agg(free) AS frees, array_agg(id) AS ids,
       array_agg(index) AS indices, array_agg(uuid) AS uuids,
       (SELECT array_agg(vm_id ORDER BY vm_id) FROM cand) AS fleet_vms,
       (SELECT array_agg(free ORDER BY vm_id) FROM cand) AS fleet_free
FROM locked
"""
LOCK_SQL = text(_LOCK_TEMPLATE.format(only_vms=""))

LOCK_SHORTLIST_SQL = text(
    f"""
WITH {LEFTOVER_GPUS}, want AS (
    SELECT * FROM unnest(CAST(:vm_ids AS integer[]), CAST(:counts AS integer[])) AS w(vm_id, n)
), cand AS (
    SELECT g.vm_id, count(*) AS free
    FROM gpus g JOIN vms v ON v.id = g.vm_id
    WHERE {USABLE_VM} AND {FREE_GPU} AND g.vm_id = ANY(CAST(:vm_ids AS integer[]))
    GROUP BY g.vm_id
), locked AS MATERIALIZED (
    -- At most `n` free rows of each VM the batch's shortlist named, in the placement's GPU
    -- order; rows another claimer holds are skipped, never waited for.
    SELECT c.vm_id, c.free, l.id, l.index, l.uuid
    FROM cand c JOIN want w ON w.vm_id = c.vm_id CROSS JOIN LATERAL (
        SELECT g.id, g.index, g.uuid FROM gpus g
        WHERE g.vm_id = c.vm_id AND {FREE_GPU}
        ORDER BY {gpu_order_sql("g")} LIMIT w.n
        FOR UPDATE OF g SKIP LOCKED
    ) l
)
SELECT array_agg(vm_id) AS vms, array_agg(free) AS frees, array_agg(id) AS ids,
       array_agg(index) AS indices, array_agg(uuid) AS uuids,
       NULL AS fleet_vms, NULL AS fleet_free
FROM locked
"""
)

# `transition(queued → starting)` fused into the take, rendered from the move's one
# definition (`jobs.move_values`). clock_timestamp(), not now(): in a batch, now() is when
# the transaction began, which can be before the GPU's previous job was released.
_CLAIM_MOVE = move_set_sql(JobStatus.QUEUED, JobStatus.STARTING, clock="clock_timestamp()")
_CLAIM_EVENT = move_event_sql(
    JobStatus.QUEUED,
    JobStatus.STARTING,
    rows="moved",
    job_id=":job_id",
    reason=":reason",
    actor=":actor",
    attempt="attempt",
)
TAKE_SQL = text(
    f"""
WITH picked AS (
    SELECT * FROM unnest(CAST(:ids AS integer[]), CAST(:ranks AS integer[]))
        WITH ORDINALITY AS p(id, rank, pos)
), taken AS (
    UPDATE gpus SET job_id = :job_id, allocated_at = clock_timestamp(),
                    updated_at = clock_timestamp()
    WHERE gpus.id = ANY(CAST(:ids AS integer[])) AND gpus.job_id IS NULL
    RETURNING gpus.id, gpus.vm_id, gpus.index, gpus.uuid
), placed AS (
    SELECT p.rank, min(t.vm_id) AS vm_id, array_agg(t.index ORDER BY p.pos) AS gpu_indices,
           array_agg(t.uuid ORDER BY p.pos) AS gpu_uuids
    FROM taken t JOIN picked p ON p.id = t.id GROUP BY p.rank
), moved AS (
    -- `transition(queued → starting)`: the same guarded UPDATE (see _CLAIM_MOVE); the job
    -- row keeps a copy of rank 0's VM and GPUs.
    UPDATE jobs SET {_CLAIM_MOVE},
        attempt = attempt + 1,
        vm_id = (SELECT vm_id FROM placed WHERE rank = 0),
        gpu_indices = (SELECT gpu_indices FROM placed WHERE rank = 0),
        gpu_uuids = (SELECT gpu_uuids FROM placed WHERE rank = 0),
        -- remote.layout.default_output_dir(installation, job_id)
        output_dir = coalesce(output_dir, '~/' || :root || '/'
                              || (SELECT CAST(id AS text) FROM installation) || '/outputs/'
                              || CAST(:job_id AS text)),
        lease_expires_at = clock_timestamp()
            + make_interval(secs => CAST(:lease_s AS double precision)),
        launch_token = :token, attempt_dir = NULL, completed_attempt = NULL,
        status_reason = NULL, failure_reason = NULL, exit_code = NULL, remote_pid = NULL
    WHERE id = :job_id AND status = 'queued'
        AND (SELECT count(*) FROM taken) = CAST(:n AS integer)
        AND EXISTS (SELECT 1 FROM installation)
    RETURNING attempt, output_dir, launch_token
), node AS (
    -- Every rank of the attempt in `job_nodes`, rank 0 included: the rows of an earlier
    -- attempt are replaced, those of ranks it no longer has go.
    INSERT INTO job_nodes (job_id, rank, attempt, vm_id, gpu_indices, gpu_uuids)
    SELECT :job_id, p.rank, m.attempt, p.vm_id, p.gpu_indices, p.gpu_uuids
    FROM placed p CROSS JOIN moved m
    ON CONFLICT (job_id, rank) DO UPDATE SET
        attempt = excluded.attempt, vm_id = excluded.vm_id,
        gpu_indices = excluded.gpu_indices, gpu_uuids = excluded.gpu_uuids,
        remote_pid = NULL, attempt_dir = NULL, exit_code = NULL, role_restarts = '{{}}'
), other_nodes AS (
    DELETE FROM job_nodes WHERE job_id = :job_id AND rank >= CAST(:nodes AS integer)
        AND EXISTS (SELECT 1 FROM moved)
), event AS (
    {_CLAIM_EVENT}
)
SELECT m.attempt, m.output_dir, m.launch_token,
       (SELECT CAST(id AS text) FROM installation) AS installation,
       (SELECT count(*) FROM taken) AS taken
FROM (SELECT 1) one LEFT JOIN moved m ON true
"""
)
