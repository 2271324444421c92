"""Move the database's clocks back instead of waiting for them: a test that needs a VM
unreachable for longer than the node-lost timeout, or a lease run out, ages the timestamp
the daemons compare with `now()`, and so neither sleeps nor depends on the machine's speed."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from scheduler.db import Database
from scheduler.models import VM, Job


async def age_outages(db: Database, seconds: float) -> None:
    """Make every current VM outage `seconds` older (VMs reachable are left alone)."""
    async with db.transaction() as session:
        await session.execute(
            update(VM)
            .where(VM.unreachable_since.is_not(None))
            .values(unreachable_since=VM.unreachable_since - timedelta(seconds=seconds))
        )


async def age_lease(db: Database, job_id: int, seconds: float) -> None:
    """Make the job's claim lease run out `seconds` earlier."""
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_expires_at.is_not(None))
            .values(lease_expires_at=Job.lease_expires_at - timedelta(seconds=seconds))
        )


async def age_progress(db: Database, job_id: int, seconds: float) -> None:
    """Make the job's current attempt `seconds` older: its launch (`running_at`) and the
    moment the poller first read its current step (`progress_changed_at`)."""
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                running_at=Job.running_at - timedelta(seconds=seconds),
                progress_changed_at=Job.progress_changed_at - timedelta(seconds=seconds),
            )
        )
