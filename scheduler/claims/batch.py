"""A batch of jobs claimed in one short transaction (docs/invariants.md, invariant 4: no
network I/O inside): its job rows are locked (rows another transaction holds are skipped
and retried), a row the launch cannot use fails its own job (`_fail_unusable`), and each
queued job is claimed in turn by the one claim path (`claim.claim`), whatever its kind,
with the shape read once from its row, unless a claim-time rule (`claims.rules`)
refuses it: it then waits `pending` with the rule's words. The same job delivered twice
is claimed once, because the second delivery finds it no longer queued."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from scheduler.attempts.shape import JobShape
from scheduler.claims.claim import CANDIDATE_VMS, claim, lock_shortlist
from scheduler.claims.result import Claim, NoClaim
from scheduler.claims.rules import ClaimGate
from scheduler.claims.why import park
from scheduler.db import Database
from scheduler.jobs import transition
from scheduler.leftovers import leftover_may_run
from scheduler.logging import get_logger
from scheduler.models import Job
from scheduler.rowcheck import job_row_problem
from scheduler.states import FailureReason, JobStatus

DEFAULT_LEASE_S = 60.0

log = get_logger("claims")

JOBS_EXISTING_SQL = text("SELECT id FROM jobs WHERE id = ANY(:ids)")


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
    jobs, busy = await _lock_jobs(conn, ids)
    # A row written by hand that the launch cannot use fails its job (config_error) here,
    # and the rest of the batch goes on.
    unusable = {row.id: job_row_problem(row) for row in jobs.values()}
    queued = [
        row for row in jobs.values() if row.status == JobStatus.QUEUED and not unusable[row.id]
    ]
    shapes = {row.id: JobShape.of_row(row) for row in queued}
    plan = [(row.id, shapes[row.id]) for row in queued if not row.leftover]
    # The rows the batch's claims look at first, locked once (a batch of one job locks
    # its own candidates on the whole fleet, as a claim that misses here does).
    pool = await lock_shortlist(conn, plan, candidates) if len(plan) > 1 else None
    gate = await ClaimGate.load(conn, queued)  # the claim-time rules (claims/rules.py)
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
        elif (refused := gate.refusal(job_id)) is not None:
            results.append(await park(conn, job_id, refused, actor))
        else:
            results.append(
                await claim(
                    conn,
                    row,
                    shapes[job_id],
                    actor=actor,
                    lease_s=lease_s,
                    candidates=candidates,
                    pool=pool,
                )
            )
        if isinstance(results[-1], Claim):
            gate.took(job_id)
        seen.add(job_id)
    return results


CLAIM_COLUMNS = (
    Job.id,
    Job.name,
    Job.status,
    Job.priority,
    Job.gpus_requested,
    Job.nodes,
    Job.model,
    Job.dataset,
    Job.reward_function,
    Job.extra_args,
    Job.env,
    Job.roles,
    Job.workdir_digest,
    Job.store,
    Job.attempt,
    Job.retry_count,
    Job.max_retries,
    Job.machine_faults,
)
"""The job row's columns a claim reads (locked with the row); a claim step reads no other.
They hold every column a claim-time rule may read (`rules.RULE_COLUMNS`)."""


async def _lock_jobs(conn: AsyncConnection, ids: list[int]) -> tuple[dict[int, Any], set[int]]:
    """The batch's job rows, locked, by id; and the ids whose rows exist but another
    transaction holds right now (`busy`)."""
    # SKIP LOCKED: a batch never waits for a job row, so it can never be one side of a
    # deadlock with another transaction that moves several jobs (requeue, poller).
    locked = (
        select(*CLAIM_COLUMNS, leftover_may_run(Job.id).label("leftover"))
        .where(Job.id.in_(ids))
        .order_by(Job.id)
        .with_for_update(skip_locked=True, of=Job)
    )
    jobs = {row.id: row for row in await conn.execute(locked)}
    busy: set[int] = set()
    if len(jobs) < len(ids):  # unknown ids, or rows another transaction holds right now
        missing = [i for i in ids if i not in jobs]
        busy = set((await conn.execute(JOBS_EXISTING_SQL, {"ids": missing})).scalars())
    return jobs, busy


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
