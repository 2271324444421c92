"""Retry decisions and machine faults live in their own columns: rewording a status reason
or an event changes no job's fate; migration 0007 fills them from what 0006 read."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect, pool, text

from scheduler import migrate
from scheduler.db import Database
from scheduler.embedded import EmbeddedPostgres
from scheduler.jobs import get_job, transition
from scheduler.models import Job
from scheduler.requeue import RequeueConfig, RequeueManager
from scheduler.retry import RetryPolicy
from scheduler.states import JobStatus
from tests.workloads.support import new_job

CONFIG = RequeueConfig(
    interval_s=0.1,
    pending_timeout_s=3600,
    republish_after_s=3600,
    policy=RetryPolicy(base_delay_s=3600, jitter=0.0, node_lost_limit=1),
)


async def fail(db: Database, job_id: int, failure: str, exit_code: int | None, why: str) -> None:
    """Move the queued job to `failed` with these words, as a daemon would."""
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=JobStatus.QUEUED,
            to=JobStatus.FAILED,
            reason=why,
            actor="test",
            values={"failure_reason": failure, "exit_code": exit_code, "status_reason": why},
        )


async def requeue(db: Database, job_id: int) -> None:
    """`failed → queued`, as a retry does."""
    async with db.transaction() as session:
        assert await transition(
            session, job_id, expected=JobStatus.FAILED, to=JobStatus.QUEUED, reason="t", actor="t"
        )


async def row(db: Database, job_id: int) -> Job:
    async with db.transaction() as session:
        return await get_job(session, job_id)


async def test_a_failure_worded_like_a_give_up_is_still_decided(db: Database) -> None:
    """Given a failure whose reason happens to start with "gave up", the requeue manager
    still decides it (it used to take the words for its own decision and leave the job
    failed for ever), and the decision is stored as `retry_decision`."""
    job_id = await new_job(db, max_retries=2)
    await fail(db, job_id, "exit_nonzero", 1, "gave up waiting for the hub: exit 1")
    manager = RequeueManager(db, None, None, CONFIG)
    report = await manager.tick()
    assert report.scheduled == [job_id]
    job = await row(db, job_id)
    assert (job.retry_decision, job.next_attempt_at is not None) == ("retry", True)
    assert (await manager.tick()).scheduled == []  # decided once
    await requeue(db, job_id)
    assert (await row(db, job_id)).retry_decision is None  # every move clears it


async def test_machine_faults_are_counted_by_the_move_whatever_the_words(db: Database) -> None:
    """Given failures that are the VM's fault but worded freely, `machine_faults` counts
    each one as it is recorded (a failed launch without exit 126/127 does not count), and
    the node-lost cap reads it: with a limit of 1, the second lost node gives up."""
    job_id = await new_job(db)
    manager = RequeueManager(db, None, None, CONFIG)
    await fail(db, job_id, "launch_failed", None, "launch failed: ssh dropped")
    assert (await row(db, job_id)).machine_faults == 0
    await requeue(db, job_id)
    await fail(db, job_id, "node_lost", None, "the VM went away")
    assert (await row(db, job_id)).machine_faults == 1
    report = await manager.tick()  # retried at once, elsewhere
    assert report.scheduled == [job_id] and report.retried == [job_id]
    await fail(db, job_id, "launch_failed", 127, "training could not start")
    job = await row(db, job_id)
    assert job.machine_faults == 2
    assert (await manager.tick()).gave_up == [job_id]
    job = await row(db, job_id)
    assert job.retry_decision == "give_up"
    assert job.status_reason == "gave up after 2 VM failures: launch_failed (exit 127) (limit 1)"


async def test_a_machine_fault_count_at_the_integer_limit_stays_there(db: Database) -> None:
    """Given a row whose `machine_faults` was written at the integer limit, one more
    machine fault is recorded (the job fails, the count stays at the limit) instead of the
    move's `machine_faults + 1` overflowing in the daemon's transaction."""
    job_id = await new_job(db)
    async with db.transaction() as session:
        await session.execute(
            text("UPDATE jobs SET machine_faults = 2147483647 WHERE id = :id"), {"id": job_id}
        )
    await fail(db, job_id, "node_lost", None, "the VM went away")
    job = await row(db, job_id)
    assert (job.status, job.machine_faults) == ("failed", 2**31 - 1)


def test_migration_0007_fills_the_columns_from_what_0006_read(postgres: EmbeddedPostgres) -> None:
    """Given jobs at revision 0006 decided by `next_attempt_at` / a "gave up" reason, and
    machine faults told by their events' reasons, upgrading to 0007 keeps every decision
    and count; downgrading to 0006 drops the columns again."""
    url = postgres.create_database("retry_columns_0007")
    migrate.upgrade(url, "0006")
    engine = create_engine(url, poolclass=pool.NullPool)
    insert_job = text(
        "INSERT INTO jobs (model, dataset, reward_function, status, status_reason,"
        " next_attempt_at) VALUES ('m', 'd', 'r', :status, :why, :at) RETURNING id"
    )
    with engine.begin() as conn:
        ids = [
            conn.execute(insert_job, {"status": status, "why": why, "at": at}).scalar_one()
            for status, why, at in (
                ("failed", "node_lost: retrying elsewhere", "2026-11-22T00:00:00Z"),
                ("failed", "gave up after 3 retries: exit_nonzero (exit 1)", None),
                ("failed", "exit_nonzero (exit 1)", None),
                ("queued", "gave up", None),
            )
        ]
        for reason in (
            "node_lost: VM a unreachable for 30s",
            "launch_failed: exit 127 (the VM's python cannot run)",
            "exit_nonzero (exit 1)",
            "vm_removed: VM b was removed while the job ran",
        ):
            conn.execute(
                text(
                    "INSERT INTO job_events (job_id, from_status, to_status, reason, actor)"
                    " VALUES (:id, 'running', 'failed', :reason, 't')"
                ),
                {"id": ids[0], "reason": reason},
            )
        conn.execute(
            text(
                "INSERT INTO job_events (job_id, from_status, to_status, reason, actor)"
                " VALUES (:id, 'running', 'queued', 'node_lost?', 't')"
            ),
            {"id": ids[1]},
        )

    migrate.upgrade(url)
    with engine.connect() as conn:
        got = conn.execute(
            text("SELECT retry_decision, machine_faults FROM jobs ORDER BY id")
        ).all()
    assert [tuple(r) for r in got] == [("retry", 3), ("give_up", 0), (None, 0), (None, 0)]

    migrate.downgrade(url, "0006")
    with engine.connect() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
    assert not {"retry_decision", "machine_faults"} & columns
    migrate.upgrade(url)
    engine.dispose()
