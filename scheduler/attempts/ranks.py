"""The ranks of an attempt as the database holds them (`job_nodes`, one row per VM): the
exit codes known so far and the job's shape. Caller's transaction; no network I/O."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler.attempts.outcome import succeeded
from scheduler.attempts.shape import JobShape
from scheduler.models import Job, JobNode


async def job_shape(session: AsyncSession, job_id: int) -> JobShape | None:
    """The shape of job `job_id` (None: no such job)."""
    row = (
        await session.execute(
            select(Job.nodes, Job.gpus_requested, Job.roles).where(Job.id == job_id)
        )
    ).first()
    return None if row is None else JobShape.of_row(row)


async def exit_codes(session: AsyncSession, job_id: int, attempt: int) -> dict[int, int | None]:
    """The exit code known for each rank of the attempt (None: not exited, or unknown)."""
    rows = await session.execute(
        select(JobNode.rank, JobNode.exit_code).where(
            JobNode.job_id == job_id, JobNode.attempt == attempt
        )
    )
    return {rank: code for rank, code in rows.all()}


async def attempt_succeeded(session: AsyncSession, job_id: int, attempt: int) -> bool:
    """Whether the attempt has succeeded by the one rule (`outcome.succeeded`), from what
    its rows record."""
    shape = await job_shape(session, job_id)
    if shape is None:
        return False
    return succeeded(shape, await exit_codes(session, job_id, attempt))
