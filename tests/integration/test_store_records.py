"""`job_store_records` on real Postgres: migration 0022 up from 0020 and back down; what
the poller records (the current attempt's reports only, each once, bounded per job, the
database refusing anything that is not a digest) and what the launch and `job pull` read
back (`scheduler.store_records`)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect, pool, text, update
from sqlalchemy.exc import IntegrityError

from scheduler import migrate
from scheduler.db import Database
from scheduler.embedded import EmbeddedPostgres
from scheduler.models import Job
from scheduler.store.binding import ACCEPTED_CHECKPOINTS, ACCEPTED_FINALS
from scheduler.store_records import accepted, record
from tests.workloads.support import new_job


def _digest(n: int) -> str:
    return f"{n:064x}"


def test_0022_upgrades_from_0020_and_downgrades_back(postgres: EmbeddedPostgres) -> None:
    url = postgres.create_database("migration_0022")
    migrate.upgrade(url, "0020")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        assert "job_store_records" not in inspect(conn).get_table_names()
    migrate.upgrade(url, "0022")
    with engine.begin() as conn:
        assert "job_store_records" in inspect(conn).get_table_names()
        job = conn.scalar(text("INSERT INTO jobs (model, dataset, reward_function) VALUES"
                               " ('m', 'd', 'f') RETURNING id"))  # fmt: skip
        conn.execute(
            text("INSERT INTO job_store_records (job_id, attempt, kind, step, digest)"
                 " VALUES (:j, 1, 'final', 0, :d)"), {"j": job, "d": _digest(1)})  # fmt: skip
    migrate.downgrade(url, "0020")
    with engine.connect() as conn:
        assert "job_store_records" not in inspect(conn).get_table_names()
    migrate.upgrade(url, "0022")
    engine.dispose()


async def _set_attempt(db: Database, job_id: int, attempt: int) -> None:
    async with db.transaction() as session:
        await session.execute(update(Job).where(Job.id == job_id).values(attempt=attempt))


async def test_the_current_attempts_reports_are_recorded_once_and_bounded(db: Database) -> None:
    job = await new_job(db, 1, store="file:///shared/runs")
    other = await new_job(db, 1, store="file:///shared/runs")
    await _set_attempt(db, job, 2)
    async with db.transaction() as session:
        added = await record(session, [
            (job, 2, "checkpoint", 4, _digest(4)),
            (job, 2, "final", 0, _digest(100)),
            (job, 1, "checkpoint", 9, _digest(9)),  # an older attempt's poll: not taken
            (other, 2, "final", 0, _digest(7)),  # `other` is at attempt 0: not taken
        ])  # fmt: skip
    assert added == 2
    async with db.transaction() as session:  # the next poll reads the same file
        assert await record(session, [(job, 2, "checkpoint", 4, _digest(4))]) == 0
        got = await accepted(session, job)
        assert (await accepted(session, other)).words() == ()
    assert got.final == {_digest(100)} and dict(got.checkpoints) == {4: {_digest(4)}}

    # A job reporting without end (its status file is its own) only pushes out its own
    # older records.
    async with db.transaction() as session:
        await record(session, [(job, 2, "checkpoint", s, _digest(1000 + s)) for s in range(50)])
        await record(session, [(job, 2, "final", 0, _digest(2000 + n)) for n in range(10)])
        got = await accepted(session, job)
    assert sorted(got.checkpoints) == list(range(50 - ACCEPTED_CHECKPOINTS, 50))
    assert len(got.final) == ACCEPTED_FINALS


@pytest.mark.parametrize(
    ("kind", "step", "digest"),
    [("final", 0, "A" * 64), ("final", 0, "a" * 63), ("final", 3, "a" * 64),
     ("model", 0, "a" * 64), ("checkpoint", -1, "a" * 64), ("checkpoint", 10**9, "a" * 64)],
)  # fmt: skip
async def test_the_database_refuses_what_is_not_a_record(
    db: Database, kind: str, step: int, digest: str
) -> None:
    job = await new_job(db, 1, store="file:///shared/runs")
    with pytest.raises(IntegrityError):
        async with db.transaction() as session:
            await record(session, [(job, 0, kind, step, digest)])
