"""The dispatcher's fast paths and `jobs.transition` write the same rows for the same move.

`queued → starting` (the claim statement) and `starting → running` (the running batch) are
hand-written SQL that render the move from `jobs.move_values`; each is run here, then
rolled back and the same move made by `transition` with the same extra values, and the job
row and event rows of both are compared column by column.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from sqlalchemy import text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from scheduler.claims.batch import claim_batch_in_session, claim_gpus
from scheduler.claims.records import Launched, mark_running_batch
from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.jobs import move_values, transition
from scheduler.models import Job
from scheduler.states import JobStatus
from tests.workloads.support import add_vm_row, new_job

Snapshot = tuple[dict[str, Any], list[tuple[Any, ...]]]


async def snapshot(conn: AsyncConnection, job_id: int) -> Snapshot:
    """The job's row and its events (without ids and times)."""
    row = (await conn.execute(text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id})).one()
    events = await conn.execute(
        text(
            "SELECT from_status, to_status, reason, actor, attempt FROM job_events "
            "WHERE job_id = :id ORDER BY id"
        ),
        {"id": job_id},
    )
    return dict(row._mapping), [tuple(e) for e in events]


def normalized(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A row with each timestamp replaced by whether the move changed it (the two paths
    run at different instants); every other column as it is."""
    return {
        column: ("changed" if value != before[column] else "kept")
        if isinstance(value, datetime) or isinstance(before[column], datetime)
        else value
        for column, value in after.items()
    }


async def both_paths(
    db: Database,
    job_id: int,
    src: JobStatus,
    to: JobStatus,
    fast: Callable[[AsyncConnection], Awaitable[None]],
    **guard: Any,
) -> tuple[Snapshot, Snapshot, dict[str, Any]]:
    """Run `fast`, then `transition` with the columns `fast` set beyond the move's own, each
    in a transaction rolled back; returns both snapshots and the row before."""
    async with db.engine.connect() as conn:
        async with conn.begin():
            before, _ = await snapshot(conn, job_id)
        async with conn.begin() as tx:
            await fast(conn)
            by_fast = await snapshot(conn, job_id)
            await tx.rollback()
        owned = set(move_values([src], to))
        extra = {
            column: value
            for column, value in by_fast[0].items()
            if column not in owned and value != before[column]
        }
        reason = by_fast[1][-1][2]
        actor = by_fast[1][-1][3]
        async with conn.begin() as tx:
            moved = await transition(
                AsyncSession(bind=conn),
                job_id,
                expected=src,
                to=to,
                reason=reason,
                actor=actor,
                values=extra,
                **guard,
            )
            assert moved
            by_transition = await snapshot(conn, job_id)
            await tx.rollback()
    return by_fast, by_transition, before


async def dirty(db: Database, job_id: int) -> None:
    """Leave a stale retry decision on the row: every move must clear it."""
    async with db.transaction() as session:
        await session.execute(update(Job).where(Job.id == job_id).values(retry_decision="give_up"))


async def test_a_claim_writes_what_transition_writes(db: Database) -> None:
    """Given a queued job, the claim statement's `queued → starting` and `transition`'s
    leave the same job row (timestamps: the same ones set) and the same event."""
    await add_vm_row(db, "a", 2)
    job_id = await new_job(db, 2)
    await dirty(db, job_id)

    async def claim(conn: AsyncConnection) -> None:
        (result,) = await claim_batch_in_session(conn, [job_id], actor="dispatcher:t")
        assert isinstance(result, Claim)

    fast, slow, before = await both_paths(db, job_id, JobStatus.QUEUED, JobStatus.STARTING, claim)
    assert fast[0]["status"] == "starting" and fast[0]["retry_decision"] is None
    assert normalized(before, fast[0]) == normalized(before, slow[0])
    assert fast[1] == slow[1]
    assert fast[1][-1] == ("queued", "starting", "claimed GPUs 0,1", "dispatcher:t", 1)


async def test_the_running_batch_writes_what_transition_writes(db: Database) -> None:
    """Given a starting job, the running batch's `starting → running` and `transition`'s
    leave the same job row and the same event."""
    await add_vm_row(db, "a", 1)
    job_id = await new_job(db)
    claim = await claim_gpus(db, job_id, actor="t")
    assert isinstance(claim, Claim)
    await dirty(db, job_id)

    async def running(conn: AsyncConnection) -> None:
        launched = Launched(job_id, claim.attempt, 4242, "started pid 4242", None)
        assert job_id in await mark_running_batch(conn, [launched], actor="dispatcher:t")

    fast, slow, before = await both_paths(
        db, job_id, JobStatus.STARTING, JobStatus.RUNNING, running, attempt=claim.attempt
    )
    assert fast[0]["status"] == "running" and fast[0]["remote_pid"] == 4242
    assert fast[0]["lease_expires_at"] is None and fast[0]["retry_decision"] is None
    assert normalized(before, fast[0]) == normalized(before, slow[0])
    assert fast[1] == slow[1]
    assert fast[1][-1] == ("starting", "running", "started pid 4242", "dispatcher:t", 1)
