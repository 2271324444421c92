"""Job moves against real Postgres: guarded, audited, and exactly one racer wins."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from scheduler.db import Database
from scheduler.jobs import get_job, transition
from scheduler.models import JobEvent
from scheduler.states import IllegalMove, JobStatus
from tests.workloads.support import new_job


async def test_a_move_updates_the_job_and_appends_an_event(db: Database) -> None:
    job_id = await new_job(db)
    async with db.transaction() as session:
        moved = await transition(
            session,
            job_id,
            expected=JobStatus.QUEUED,
            to=JobStatus.PENDING,
            reason="needs 4 GPUs, largest free block is 2",
            actor="test",
            values={"status_reason": "needs 4 GPUs, largest free block is 2"},
        )
    assert moved
    async with db.transaction() as session:
        job = await get_job(session, job_id, with_events=True)
    assert job.status == "pending"
    assert job.pending_at is not None
    assert job.status_reason == "needs 4 GPUs, largest free block is 2"
    assert [(e.from_status, e.to_status) for e in job.events] == [
        (None, "queued"),
        ("queued", "pending"),
    ]


async def test_a_move_from_the_wrong_state_changes_nothing(db: Database) -> None:
    job_id = await new_job(db)
    async with db.transaction() as session:
        moved = await transition(
            session,
            job_id,
            expected=JobStatus.RUNNING,
            to=JobStatus.COMPLETED,
            reason="x",
            actor="t",
        )
    assert not moved
    async with db.transaction() as session:
        job = await get_job(session, job_id, with_events=True)
    assert job.status == "queued"
    assert len(job.events) == 1


async def test_a_forbidden_move_raises_before_touching_the_database(db: Database) -> None:
    job_id = await new_job(db)
    # The raise is caught inside the transaction, so it commits: anything written before
    # the raise would be kept and seen below.
    async with db.transaction() as session:
        with pytest.raises(IllegalMove):
            await transition(
                session,
                job_id,
                expected=JobStatus.QUEUED,
                to=JobStatus.RUNNING,
                reason="x",
                actor="t",
            )
    async with db.transaction() as session:
        job = await get_job(session, job_id, with_events=True)
    assert job.status == "queued"
    assert [(e.from_status, e.to_status) for e in job.events] == [(None, "queued")]


async def test_with_several_possible_sources_the_event_records_the_real_one(db: Database) -> None:
    job_id = await new_job(db)
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=[JobStatus.QUEUED, JobStatus.PENDING, JobStatus.STARTING],
            to=JobStatus.CANCELLED,
            reason="user asked",
            actor="cli",
        )
    async with db.transaction() as session:
        job = await get_job(session, job_id, with_events=True)
    assert job.status == "cancelled"
    assert job.events[-1].from_status == "queued"


async def test_two_concurrent_movers_exactly_one_wins(db: Database) -> None:
    """Given a queued job, when two dispatchers race to start it, then one wins, once."""
    job_ids = [await new_job(db) for _ in range(20)]

    async def mover(job_id: int, name: str, gate: asyncio.Barrier) -> bool:
        async with db.transaction() as session:
            await gate.wait()
            return await transition(
                session,
                job_id,
                expected=JobStatus.QUEUED,
                to=JobStatus.STARTING,
                reason=name,
                actor=name,
            )

    for job_id in job_ids:
        gate = asyncio.Barrier(2)
        results = await asyncio.gather(mover(job_id, "d1", gate), mover(job_id, "d2", gate))
        assert sorted(results) == [False, True]
    async with db.transaction() as session:
        events = (
            await session.scalars(select(JobEvent).where(JobEvent.to_status == "starting"))
        ).all()
    assert sorted(e.job_id for e in events) == sorted(job_ids)


async def test_news_about_an_old_attempt_cannot_move_the_next_one(db: Database) -> None:
    """Given a job on its second attempt, a failure reported for attempt 1 changes nothing."""
    job_id = await new_job(db)
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=JobStatus.QUEUED,
            to=JobStatus.STARTING,
            reason="claimed",
            actor="t",
            values={"attempt": 2},
        )
    async with db.transaction() as session:
        stale = await transition(
            session,
            job_id,
            expected=JobStatus.STARTING,
            to=JobStatus.FAILED,
            reason="launch failed",
            actor="t",
            attempt=1,
        )
        current = await transition(
            session,
            job_id,
            expected=JobStatus.STARTING,
            to=JobStatus.RUNNING,
            reason="pid 42",
            actor="t",
            attempt=2,
        )
    assert (stale, current) == (False, True)
    async with db.transaction() as session:
        assert (await get_job(session, job_id)).status == "running"
