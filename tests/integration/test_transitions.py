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


async def wait_round(db: Database, job_id: int, reason: str = "no GPU free") -> None:
    """One round of a waiting job: parked pending by the dispatcher, woken by the requeue
    manager (the two moves of `claims` and `requeue_steps.wake_pending`)."""
    async with db.transaction() as session:
        assert await transition(
            session, job_id, expected=JobStatus.QUEUED, to=JobStatus.PENDING,
            reason=reason, actor="dispatcher:h:1",
        )  # fmt: skip
    async with db.transaction() as session:
        assert await transition(
            session, job_id, expected=JobStatus.PENDING, to=JobStatus.QUEUED,
            reason="pending for 300s: looking again", actor="requeue",
        )  # fmt: skip


async def test_a_waiting_job_keeps_one_event_per_reason_with_a_count_and_last_time(
    db: Database,
) -> None:
    from scheduler.jobs import show_job

    job_id = await new_job(db)
    # Given a job that waited 40 rounds for a GPU
    for _ in range(40):
        await wait_round(db, job_id)
    # When it waits once for another reason, then runs, fails and waits again
    await wait_round(db, job_id, reason="needs 2 GPUs, largest free block is 1")
    async with db.transaction() as session:
        for src, to in (("queued", "starting"), ("starting", "failed"), ("failed", "queued")):
            assert await transition(
                session, job_id, expected=JobStatus(src), to=JobStatus(to), reason=to, actor="t"
            )
    for _ in range(3):
        await wait_round(db, job_id)
    async with db.transaction() as session:
        events = (await show_job(session, job_id))["events"]
    # Then each reason of a waiting spell is one row, counted, with when it was last seen
    seen = [(e["from"], e["to"], e["reason"], e["count"]) for e in events]
    assert seen == [
        (None, "queued", "submitted", 1),
        ("queued", "pending", "no GPU free", 40),
        ("pending", "queued", "pending for 300s: looking again", 41),
        ("queued", "pending", "needs 2 GPUs, largest free block is 1", 1),
        ("queued", "starting", "starting", 1),
        ("starting", "failed", "failed", 1),
        ("failed", "queued", "queued", 1),
        ("queued", "pending", "no GPU free", 3),
        ("pending", "queued", "pending for 300s: looking again", 3),
    ]
    assert events[1]["last_at"] > events[1]["at"]
    assert events[3]["last_at"] is None
