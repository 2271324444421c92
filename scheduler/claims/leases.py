"""Claims whose launch was never confirmed: `expire_leases` takes them back (run by the
requeue manager each tick)."""

from __future__ import annotations

from sqlalchemy import func, or_, select

from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.db import Database
from scheduler.logging import get_logger
from scheduler.models import Job
from scheduler.states import JobStatus

log = get_logger("claims")

LEASE_EXPIRED = "claim lease expired before the launch was confirmed"


async def expire_leases(db: Database, *, actor: str = "requeue") -> list[int]:
    """Take back claims whose launch was never confirmed: `starting` jobs past their lease
    (or with none: a row no claim wrote).

    Each such job goes back to `queued` (publish it again) and its GPUs are freed. The
    attempt may still have started on the VM (a dispatcher that died after the launch but
    before recording it), so it is left over (`attempts.end`, `attempts.finish.end_attempt`):
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
        end = decide(None, RankEnd(How.LEASE_EXPIRED, LEASE_EXPIRED))
        for row in rows:
            if await end_attempt(
                session, AttemptRecord.from_row(row), end, expected=JobStatus.STARTING, actor=actor
            ):
                expired.append(row.id)
    for job_id in expired:
        log.warning("lease_expired", job_id=job_id)
    return expired
