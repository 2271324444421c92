"""GPU claims: take free GPUs for jobs atomically, expire dead claims.

A batch of jobs is claimed in one short transaction (docs/invariants.md, invariant 4: no network
I/O inside):
its job rows are locked (rows another transaction holds are skipped and retried), then for
each job in turn one statement picks the best-fitting VM, takes its GPU rows with
`FOR UPDATE SKIP LOCKED` and moves the job `queued → starting` with a lease; a job that
fits nowhere moves `queued → pending` in the same transaction. Two dispatchers racing for
the same GPUs can never both win a row (docs/invariants.md, invariant 1); the same job delivered
twice is
claimed once, because the second delivery finds it no longer queued. The launched jobs of
a batch are then recorded `running` by one statement (`mark_running_batch`), again with
their event rows.

A batch counts the free GPUs once and plans a shortlist of VMs (`placement.shortlist`), so
that each claim looks at a few VMs' rows instead of counting the whole fleet again; a claim that
misses there falls back to the whole fleet, which alone decides pending and contended.

What a free GPU is, and giving GPUs back, is `scheduler.gpus`; attempts left behind on a
VM are `scheduler.leftovers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, literal_column, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from scheduler import jobstore
from scheduler.db import Database, installation_id
from scheduler.gpus import (
    FREE_BY_VM_SQL,
    FREE_GPU,
    LEFTOVER_GPUS,
    LOCK_FREE_ON_VM_SQL,
    USABLE_VM,
    VM_SIZES_SQL,
)
from scheduler.jobs import move_event_sql, move_set_sql, transition
from scheduler.leftovers import AttemptRecord, abandon_attempt, leftover_may_run
from scheduler.logging import get_logger
from scheduler.models import Job, JobNode, JobPort
from scheduler.placement import (
    demand_order,
    demands_fit,
    short_of,
    shortlist,
    tie_break_sql,
    unsatisfiable_gang_reason,
    unsatisfiable_reason,
    vm_order,
)
from scheduler.remote.layout import ROOT, Attempt, default_output_dir, new_token
from scheduler.rowcheck import job_row_problem
from scheduler.states import FailureReason, JobStatus

DEFAULT_LEASE_S = 60.0
CANDIDATE_VMS = 4
"""How many best-fitting VMs one claim statement tries; more than one so that a VM whose
free GPUs another dispatcher holds locked right now does not make the claim miss."""

log = get_logger("claims")

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
    ORDER BY free, {tie_break_sql('vm_id', ':job_id')} LIMIT :candidates
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
    ORDER BY f.free, {tie_break_sql('l.vm_id', ':job_id')} LIMIT 1
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


def gang_pending_reason(nodes: int, need: int, fitting: int) -> str:
    """Why a multi-node job waits, in the words `job list` shows."""
    unit = "GPU" if need == 1 else "GPUs"
    verb = "has" if fitting == 1 else "have"
    return f"needs {nodes} VMs with {need} free {unit}; {fitting} {verb} them"


JOBS_EXISTING_SQL = text("SELECT id FROM jobs WHERE id = ANY(:ids)")

_RUNNING_MOVE = move_set_sql(JobStatus.STARTING, JobStatus.RUNNING)
_RUNNING_EVENT = move_event_sql(
    JobStatus.STARTING,
    JobStatus.RUNNING,
    rows="moved",
    job_id="id",
    reason="reason",
    actor=":actor",
    attempt="attempt",
)
MARK_RUNNING_BATCH_SQL = text(
    f"""
WITH launched AS (
    SELECT * FROM unnest(CAST(:job_ids AS bigint[]), CAST(:attempts AS integer[]),
                         CAST(:pids AS integer[]), CAST(:reasons AS text[]),
                         CAST(:dirs AS text[]))
                  AS l(job_id, attempt, pid, reason, dir)
), locked AS MATERIALIZED (
    -- Job rows locked in id order, as every transaction that moves several jobs should.
    SELECT j.id FROM jobs j WHERE j.id IN (SELECT job_id FROM launched)
    ORDER BY j.id FOR UPDATE
), moved AS (
    -- `transition(starting → running)` for each launched attempt (see _RUNNING_MOVE).
    UPDATE jobs SET {_RUNNING_MOVE},
                    remote_pid = l.pid, attempt_dir = l.dir, lease_expires_at = NULL
    FROM launched l
    WHERE jobs.id = l.job_id AND jobs.id IN (SELECT id FROM locked)
      AND jobs.status = 'starting' AND jobs.attempt = l.attempt
    RETURNING jobs.id, jobs.attempt, jobs.queued_at, jobs.starting_at, jobs.submitted_at,
              jobs.running_at, l.reason
), node AS (
    -- Rank 0's pid and directory on its `job_nodes` row too (the job row mirrors them).
    UPDATE job_nodes SET remote_pid = l.pid, attempt_dir = l.dir
    FROM launched l
    WHERE job_nodes.job_id = l.job_id AND job_nodes.rank = 0
      AND job_nodes.attempt = l.attempt AND job_nodes.job_id IN (SELECT id FROM moved)
), event AS (
    {_RUNNING_EVENT}
)
SELECT id, attempt, queued_at, starting_at, submitted_at, running_at FROM moved
"""
)


@dataclass(frozen=True)
class NodeClaim:
    """One rank of a gang claim: the VM and GPUs it runs on."""

    rank: int
    vm_id: int
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    """GPUs taken for a job that is now `starting`, and what its launch needs."""

    job_id: int
    attempt: int
    vm_id: int
    gpu_indices: list[int]
    output_dir: str
    model: str = ""
    dataset: str = ""
    reward_functions: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    """The claimed GPUs' UUIDs, in the order of `gpu_indices`: what the attempt runs on."""
    installation: str = ""
    token: str = ""

    @property
    def run(self) -> Attempt:
        """The claimed attempt and its directory name (docs/invariants.md, invariant 6)."""
        return Attempt(self.installation, self.job_id, self.attempt, self.token)

    env: tuple[tuple[str, str], ...] = ()
    nodes: tuple[NodeClaim, ...] = ()
    """Every rank of a multi-node job, rank 0 first (its VM and GPUs are `vm_id`,
    `gpu_indices`, `gpu_uuids`); empty for a single-node job."""
    roles: dict[str, Any] | None = None
    """A job group's roles (`jobs.roles`, checked by `job_row_problem`); None for a job of
    one training role."""


@dataclass(frozen=True)
class NoClaim:
    """Nothing was claimed. `status` is the job's state now (None: no such job, or not
    known yet); `contended` means GPUs would fit but other claimers hold them locked, or
    another transaction holds the job's row: try again soon."""

    job_id: int
    status: str | None
    reason: str | None = None
    contended: bool = False
    moved_to_pending: bool = False
    waiting: bool = False
    """An earlier attempt of the job may still run (`leftover_may_run`): ask again once
    the requeue manager has killed it."""
    rejected: bool = False
    """The job row cannot be launched (`rowcheck.job_row_problem`): it failed just now."""


def job_env_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """A job row's `env` as (key, value) pairs; entries that are not string pairs a job may
    set (a row written by hand) are left out rather than trusted."""
    from scheduler.validate import env_key_problem

    if not isinstance(value, dict):
        return ()
    return tuple(
        (k, v)
        for k, v in sorted(value.items())
        if isinstance(k, str)
        and isinstance(v, str)
        and env_key_problem(k) is None
        and not any(c in v for c in "\r\n\0")
    )


def pending_reason(need: int, largest_free: int) -> str:
    """Why a job waits, in the words `job list` shows."""
    unit = "GPU" if need == 1 else "GPUs"
    return f"needs {need} {unit}, largest free block is {largest_free}"


async def claim_batch_in_session(
    conn: AsyncConnection,
    job_ids: Sequence[int],
    *,
    actor: str,
    lease_s: float = DEFAULT_LEASE_S,
    candidates: int = CANDIDATE_VMS,
) -> list[Claim | NoClaim]:
    """Claim GPUs for each job of `job_ids`, in order, inside the caller's transaction.

    Each queued job moves `queued → starting` (lease, attempt + 1, VM, GPUs, output dir)
    when a VM fits, `queued → pending` with the reason when none does; a job that is not
    `queued`, unknown, or already seen earlier in the batch is left untouched. Returns one
    result per entry of `job_ids`, in the same order.
    """
    ids = sorted(set(job_ids))
    # SKIP LOCKED: a batch never waits for a job row, so it can never be one side of a
    # deadlock with another transaction that moves several jobs (requeue, poller).
    locked = (
        select(
            Job.id,
            Job.status,
            Job.gpus_requested,
            Job.nodes,
            Job.model,
            Job.dataset,
            Job.reward_function,
            Job.extra_args,
            Job.env,
            Job.roles,
            Job.attempt,
            Job.retry_count,
            Job.max_retries,
            Job.machine_faults,
            leftover_may_run(Job.id).label("leftover"),
        )
        .where(Job.id.in_(ids))
        .order_by(Job.id)
        .with_for_update(skip_locked=True, of=Job)
    )
    jobs = {row.id: row for row in await conn.execute(locked)}
    busy: set[int] = set()
    if len(jobs) < len(ids):  # unknown ids, or rows another transaction holds right now
        missing = [i for i in ids if i not in jobs]
        busy = set((await conn.execute(JOBS_EXISTING_SQL, {"ids": missing})).scalars())
    # A row written by hand that the launch cannot use fails its job (config_error) here,
    # and the rest of the batch goes on.
    unusable = {row.id: job_row_problem(row) for row in jobs.values()}
    queued = [
        row for row in jobs.values() if row.status == JobStatus.QUEUED and not unusable[row.id]
    ]
    single = [row for row in queued if row.nodes == 1]
    shortlist = await _shortlist(conn, single, candidates) if len(single) > 1 else None
    results: list[Claim | NoClaim] = []
    seen: set[int] = set()
    for job_id in job_ids:
        row = jobs.get(job_id)
        if job_id in busy:
            # Its commit is a moment away: try again, as with contended GPUs.
            results.append(NoClaim(job_id, None, "job row locked", contended=True))
        elif row is None:
            results.append(NoClaim(job_id, None, "no such job"))
        elif job_id in seen:
            results.append(NoClaim(job_id, row.status, "delivered twice in one batch"))
        elif row.status != JobStatus.QUEUED:
            results.append(NoClaim(job_id, row.status, f"job is {row.status}"))
        elif row.leftover:
            reason = "an earlier attempt may still run; it is being killed"
            results.append(NoClaim(job_id, row.status, reason, waiting=True))
        elif unusable[job_id]:
            results.append(await _fail_unusable(conn, job_id, unusable[job_id] or "", actor))
        elif row.nodes > 1:
            results.append(await _claim_gang(conn, row, actor, lease_s))
        else:
            results.append(await _claim_one(conn, row, actor, lease_s, candidates, shortlist))
        seen.add(job_id)
    return results


async def _fail_unusable(conn: AsyncConnection, job_id: int, problem: str, actor: str) -> NoClaim:
    """`queued → failed` with `config_error`: the row cannot be launched as it is, and
    never will be (the retry policy does not retry a config_error)."""
    reason = f"invalid job: {problem}"[:500]
    moved = await transition(
        AsyncSession(bind=conn),
        job_id,
        expected=JobStatus.QUEUED,
        to=JobStatus.FAILED,
        reason=reason,
        actor=actor,
        values={"failure_reason": FailureReason.CONFIG_ERROR.value, "status_reason": reason},
    )
    if moved:
        log.warning("job_invalid", job_id=job_id, reason=reason)
    return NoClaim(job_id, JobStatus.FAILED.value if moved else None, reason, rejected=moved)


async def _shortlist(conn: AsyncConnection, rows: Sequence[Any], candidates: int) -> list[int]:
    """The VMs a batch's claims look at first (`placement.shortlist` over one count of the
    free GPUs)."""
    free = (await conn.execute(FREE_BY_VM_SQL)).all()
    return shortlist(
        ((vm_id, n) for vm_id, n in free),
        ((row.id, row.gpus_requested) for row in rows),
        candidates,
    )


async def _claim_one(
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
            roles=row.roles,
        )
    if result.largest_free >= need:
        # Free GPUs exist but other claimers hold them: not a reason to wait.
        return NoClaim(job_id, row.status, "contended", contended=True)
    largest_vm = int(await conn.scalar(LARGEST_VM_SQL) or 0)
    reason = (
        unsatisfiable_reason(need, largest_vm)
        if need > largest_vm
        else pending_reason(need, result.largest_free)
    )
    moved = await transition(
        AsyncSession(bind=conn),  # a session over the connection joins its transaction
        job_id,
        expected=JobStatus.QUEUED,
        to=JobStatus.PENDING,
        reason=reason,
        actor=actor,
        values={"status_reason": reason},
    )
    return NoClaim(job_id, JobStatus.PENDING.value, reason, moved_to_pending=moved)


def gang_demands(row: Any) -> list[int]:
    """The GPUs each node (rank) of a multi-node job needs, rank 0 first: `nodes` × the
    job's `gpus_requested`; for a job group spread over several VMs, each node of its
    layout (`GroupSpec.layout`). The row was checked first (`job_row_problem`)."""
    roles = getattr(row, "roles", None)
    if roles is not None:
        from scheduler.jobspec import parse_data

        return [node.gpus for node in parse_data(roles).layout()]
    return [int(row.gpus_requested)] * int(row.nodes)


def _demands_text(demands: Sequence[int]) -> str:
    """`4, 2 and 1`: a gang's per-node GPU counts, most first, in a reason."""
    words = [str(n) for n in sorted(demands, reverse=True)]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def gang_wait_reason(demands: Sequence[int], free_by_vm: dict[int, int]) -> str:
    """Why a gang with these per-node demands waits on VMs with these free GPUs (the
    words of `gang_pending_reason` when every node needs the same)."""
    short = short_of(free_by_vm, list(demands))
    n, need, have = short or (len(demands), max(demands), len(free_by_vm))
    if len(set(demands)) == 1:
        return gang_pending_reason(len(demands), need, have)
    return (
        f"needs {len(demands)} VMs with {_demands_text(demands)} free GPUs; "
        f"{have} VM(s) have {need} free, {n} needed"
    )


def gang_never_reason(demands: Sequence[int], sizes: dict[int, int]) -> str | None:
    """Why a gang can never run on VMs of these sizes (None when it could): the words of
    `unsatisfiable_gang_reason` when every node needs the same."""
    short = short_of(sizes, list(demands))
    if short is None:
        return None
    n, need, have = short
    if len(set(demands)) == 1:
        return unsatisfiable_gang_reason(len(demands), need, have)
    return (
        f"needs {len(demands)} VMs with {_demands_text(demands)} GPUs; "
        f"only {have} VM(s) have {need} or more, {n} needed"
    )


async def _lock_gang(
    conn: AsyncConnection, free: dict[int, int], demands: Sequence[int], job_id: int
) -> list[tuple[int, list[Any]]] | None:
    """Lock `demands[r]` free GPU rows for each node r, every node on a VM of its own:
    nodes most demanding first (`demand_order`), each on the first VM of `vm_order` not
    tried yet whose rows it can lock (SKIP LOCKED). None when some node found none."""
    chosen: dict[int, tuple[int, list[Any]]] = {}
    tried: set[int] = set()
    for node in demand_order(list(demands)):
        need = demands[node]
        for vm_id in vm_order(free, need, job_id):
            if vm_id in tried:
                continue
            tried.add(vm_id)
            gpus = (await conn.execute(LOCK_FREE_ON_VM_SQL, {"vm_id": vm_id, "need": need})).all()
            if len(gpus) == need:
                chosen[node] = (vm_id, list(gpus))
                break
        else:
            return None
    return [chosen[node] for node in range(len(demands))]


async def _claim_gang(
    conn: AsyncConnection,
    row: Any,
    actor: str,
    lease_s: float,
    demands: Sequence[int] | None = None,
) -> Claim | NoClaim:
    """Claim the GPUs of every node of one queued, locked multi-node job (`demands`, one
    GPU count per node; `gang_demands(row)` when not given), all in the caller's
    transaction or none (docs/invariants.md, invariant 1): lock the free GPU rows of each
    node on a VM of its own (`_lock_gang`), and only once every node is locked take them
    and move the job `queued → starting`; else take nothing and say why."""
    job_id = row.id
    demands = list(demands if demands is not None else gang_demands(row))
    free = {int(vm): int(n) for vm, n in (await conn.execute(FREE_BY_VM_SQL)).all()}
    chosen = await _lock_gang(conn, free, demands, job_id) if demands_fit(free, demands) else None
    if chosen is None:
        if demands_fit(free, demands):
            # Enough VMs fit, but other claimers hold their rows: not a reason to wait.
            return NoClaim(job_id, row.status, "contended", contended=True)
        return await _park_gang(conn, row, actor, demands, free)
    ranks = tuple(
        NodeClaim(
            rank,
            vm_id,
            tuple(int(g.index) for g in gpus),
            tuple(str(g.uuid) for g in gpus),
        )
        for rank, (vm_id, gpus) in enumerate(chosen)
    )
    ids = [g.id for _vm, gpus in chosen for g in gpus]
    taken = await conn.execute(
        text(
            "UPDATE gpus SET job_id = :job_id, allocated_at = clock_timestamp(), "
            "updated_at = clock_timestamp() WHERE id = ANY(:ids) AND job_id IS NULL "
            "RETURNING id"
        ),
        {"job_id": job_id, "ids": ids},
    )
    if len(taken.all()) != len(ids):  # cannot happen under the row locks; never half
        raise RuntimeError(f"gang claim of job {job_id} lost a locked GPU row")
    installation = await installation_id(conn)
    token = new_token()
    first = ranks[0]
    moved = await transition(
        AsyncSession(bind=conn),
        job_id,
        expected=JobStatus.QUEUED,
        to=JobStatus.STARTING,
        reason=f"claimed {_claimed_text(demands)} GPUs on VMs "
        + ",".join(str(r.vm_id) for r in ranks),
        actor=actor,
        values={
            "attempt": Job.attempt + 1,
            "vm_id": first.vm_id,
            "gpu_indices": list(first.gpu_indices),
            "gpu_uuids": list(first.gpu_uuids),
            "output_dir": func.coalesce(Job.output_dir, default_output_dir(installation, job_id)),
            "lease_expires_at": func.clock_timestamp()
            + literal_column(f"make_interval(secs => {float(lease_s)!r})"),
            "launch_token": token,
            "attempt_dir": None,
            "completed_attempt": None,
            "status_reason": None,
            "failure_reason": None,
            "exit_code": None,
            "remote_pid": None,
        },
    )
    if not moved:  # the row is locked and queued: cannot happen; take nothing
        raise RuntimeError(f"gang claim of job {job_id} could not move it")
    job = (await conn.execute(select(Job.attempt, Job.output_dir).where(Job.id == job_id))).one()
    await conn.execute(delete(JobNode).where(JobNode.job_id == job_id))
    await conn.execute(
        insert(JobNode),
        [
            {
                "job_id": job_id,
                "rank": r.rank,
                "attempt": job.attempt,
                "vm_id": r.vm_id,
                "gpu_indices": list(r.gpu_indices),
                "gpu_uuids": list(r.gpu_uuids),
            }
            for r in ranks
        ],
    )
    return Claim(
        job_id,
        job.attempt,
        first.vm_id,
        list(first.gpu_indices),
        job.output_dir,
        model=row.model,
        dataset=row.dataset,
        reward_functions=tuple(r for r in row.reward_function.split(",") if r),
        extra_args=tuple(str(a) for a in row.extra_args or ()),
        gpu_uuids=first.gpu_uuids,
        installation=installation,
        token=token,
        env=job_env_pairs(row.env),
        nodes=ranks,
        roles=row.roles,
    )


def _claimed_text(demands: Sequence[int]) -> str:
    """`2 × 4` (every node alike) or `4+2+1` (per node, rank 0 first), in an event."""
    if len(set(demands)) == 1:
        return f"{len(demands)} × {demands[0]}"
    return "+".join(str(n) for n in demands)


async def _park_gang(
    conn: AsyncConnection, row: Any, actor: str, demands: Sequence[int], free: dict[int, int]
) -> NoClaim:
    """`queued → pending` for a multi-node job that fits nowhere now, with the reason."""
    sizes = dict(enumerate(int(n) for n in (await conn.scalars(VM_SIZES_SQL)).all()))
    reason = gang_never_reason(demands, sizes) or gang_wait_reason(demands, free)
    moved = await transition(
        AsyncSession(bind=conn),
        row.id,
        expected=JobStatus.QUEUED,
        to=JobStatus.PENDING,
        reason=reason,
        actor=actor,
        values={"status_reason": reason},
    )
    return NoClaim(row.id, JobStatus.PENDING.value, reason, moved_to_pending=moved)


async def claim_batch(
    db: Database, job_ids: Sequence[int], *, actor: str, lease_s: float = DEFAULT_LEASE_S
) -> list[Claim | NoClaim]:
    """`claim_batch_in_session` in one short transaction of its own.

    It runs on a bare connection, not an ORM session: this is the hot path."""
    if not job_ids:
        return []
    async with db.engine.begin() as conn:
        return await claim_batch_in_session(conn, job_ids, actor=actor, lease_s=lease_s)


async def claim_gpus(
    db: Database, job_id: int, *, actor: str, lease_s: float = DEFAULT_LEASE_S
) -> Claim | NoClaim:
    """Claim GPUs for one queued job in a short transaction (a batch of one)."""
    return (await claim_batch(db, [job_id], actor=actor, lease_s=lease_s))[0]


@dataclass(frozen=True)
class Running:
    """A job just moved `starting → running`, with the timestamps metrics want."""

    attempt: int
    queued_at: datetime | None
    starting_at: datetime | None
    submitted_at: datetime | None
    running_at: datetime | None


@dataclass(frozen=True)
class Launched:
    """An attempt the VM says it started: the pid of its process-group leader, and the
    absolute directory the launch reported (None if it reported none)."""

    job_id: int
    attempt: int
    pid: int
    reason: str
    attempt_dir: str | None = None


async def mark_running_batch(
    conn: AsyncConnection, launched: Sequence[Launched], *, actor: str
) -> dict[int, Running]:
    """`transition(starting → running)` for each launched attempt, in ONE statement with
    their event rows (caller's transaction); returns the moved jobs by id.

    A job missing from the result is no longer `starting` at that attempt (cancelled, or
    its lease expired and it was claimed again): the caller must not let that attempt run.
    """
    if not launched:
        return {}
    rows = await conn.execute(
        MARK_RUNNING_BATCH_SQL,
        {
            "job_ids": [x.job_id for x in launched],
            "attempts": [x.attempt for x in launched],
            "pids": [x.pid for x in launched],
            "reasons": [x.reason for x in launched],
            "dirs": [x.attempt_dir for x in launched],
            "actor": actor,
        },
    )
    return {row.id: Running(*row[1:]) for row in rows}


async def record_ranks(
    conn: AsyncConnection, job_id: int, attempt: int, ranks: Sequence[tuple[int, int, str | None]]
) -> None:
    """Record each launched rank's (rank, pid, absolute directory) of a multi-node attempt
    (caller's transaction); rows of another attempt are left alone."""
    for rank, pid, path in ranks:
        await conn.execute(
            update(JobNode)
            .where(JobNode.job_id == job_id, JobNode.rank == rank, JobNode.attempt == attempt)
            .values(remote_pid=pid, attempt_dir=path)
        )


class PortCollision(Exception):
    """A port a VM said was free is recorded for another live attempt there: ask again."""


async def record_group_ports(
    conn: AsyncConnection,
    job_id: int,
    attempt: int,
    ports: Sequence[tuple[int, str, str, int]],
) -> None:
    """Record the (VM, role, name, port) a job group's attempt got on each of its VMs
    (caller's transaction), replacing the job's earlier rows; `PortCollision` (roll back)
    when another attempt holds one of them on that VM."""
    await conn.execute(delete(JobPort).where(JobPort.job_id == job_id))
    if not ports:
        return
    rows = [
        {"vm_id": vm, "port": port, "job_id": job_id, "attempt": attempt, "role": r, "name": n}
        for vm, r, n, port in ports
    ]
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    taken = await conn.execute(
        pg_insert(JobPort).values(rows).on_conflict_do_nothing().returning(JobPort.port)
    )
    if len(taken.all()) != len(rows):
        raise PortCollision(f"a port of job {job_id} is held by another attempt on its VM")


async def expire_leases(db: Database, *, actor: str = "requeue") -> list[int]:
    """Take back claims whose launch was never confirmed: `starting` jobs past their lease
    (or with none: a row no claim wrote).

    Each such job goes back to `queued` (publish it again) and its GPUs are freed. The
    attempt may still have started on the VM (a dispatcher that died after the launch but
    before recording it), so it is abandoned as a leftover (`leftovers.abandon_attempt`):
    its GPUs are not offered again until that attempt is known to be dead (the kill reads
    its pid file). Returns the ids of the jobs requeued.
    """
    expired: list[int] = []
    async with db.transaction() as session:
        rows = (
            await session.execute(
                select(*AttemptRecord.columns())
                .where(
                    Job.status == JobStatus.STARTING.value,
                    # No lease at all: a row no claim wrote (by hand); it would wait for ever.
                    or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < func.now()),
                )
                .order_by(Job.id)
                .with_for_update(skip_locked=True)
            )
        ).all()
        for row in rows:
            if await abandon_attempt(
                session,
                AttemptRecord.from_row(row),
                expected=JobStatus.STARTING,
                to=JobStatus.QUEUED,
                reason="claim lease expired before the launch was confirmed",
                actor=actor,
                leftover="lease_expired",
                values={"published_at": None},
            ):
                expired.append(row.id)
    for job_id in expired:
        log.warning("lease_expired", job_id=job_id)
    return expired
