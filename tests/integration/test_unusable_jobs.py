"""Jobs that can never run do not stall the queue, and a job row the launch cannot use
fails its job, not its batch: real Postgres, real NATS, a real SSH fleet."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import nats as nats_client
import pytest
from nats.aio.client import Client as NATS
from sqlalchemy import text, update

from scheduler import bus, fleet, jobstore
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.jobs import list_jobs, show_job
from scheduler.models import GPU
from scheduler.pgconn import PgDatabase
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from tests.fleet import SimFleet
from tests.workloads.support import (
    add_vm_row,
    job_row,
    new_job,
    polled_fleet,
    publish,
    running_dispatcher,
    wait_status,
)

STARVING = RequeueConfig(
    interval_s=0.1,
    pending_timeout_s=3600,
    recheck_after_s=0,
    starvation_after_s=0.0,
    republish_after_s=3600,
)


@pytest.fixture
async def nc(nats: EmbeddedNats) -> AsyncIterator[NATS]:
    """A plain NATS client, as a user's script would have, with the stream in place."""
    client = await nats_client.connect(nats.url)
    await bus.ensure_stream(client.jetstream())
    yield client
    await client.close()


async def _foreign_busy(db: Database, busy: bool) -> None:
    """What the poller writes when a process rlfleet did not start holds every GPU."""
    async with db.transaction() as session:
        await session.execute(update(GPU).values(foreign_busy=busy))


async def test_a_job_no_vm_can_run_is_pending_with_why_and_holds_back_nobody(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, nats: EmbeddedNats, nc: NATS
) -> None:
    """Given a 3-GPU job accepted while a 4-GPU VM existed, when that VM is removed, the
    job goes pending with "no VM has 3 GPUs", and a 1-GPU job pending behind it (after
    the starvation threshold) is still woken and runs on the 2-GPU VM that is left."""
    await polled_fleet(sim_fleet, db, 1, 2)
    await add_vm_row(db, "big", 4, status="unreachable")
    big = await new_job(db, gpus=3, extra=("--fake_seconds", "30"))
    small = await new_job(db, gpus=1, extra=("--fake_seconds", "30"))
    async with db.transaction() as session:
        await fleet.remove_vm(session, "big")

    async with running_dispatcher(db, nats.url):
        await publish(nc, big)
        pending = await wait_status(db, big, "pending")
        assert pending.status_reason == "no VM has 3 GPUs (the largest has 2)"

        await _foreign_busy(db, True)  # the small job finds no free GPU: pending too
        await publish(nc, small)
        await wait_status(db, small, "pending")
        await _foreign_busy(db, False)  # the GPUs are free again

        manager = RequeueManager(db, NatsPublisher(nc), None, STARVING)
        report = await manager.tick()
        assert small in report.unpended
        assert big not in report.unpended
        await wait_status(db, small, {"starting", "running"})
    assert (await job_row(db, big)).status == "pending"


BAD_ROWS = {
    # (extra_args as JSON, gpus_requested) → what the reason must say
    ("5", 1): "extra_args must be a JSON array of strings, not a JSON number",
    ('{"max_steps": 5}', 1): "not a JSON object",
    ('"--max_steps 5"', 1): "not a JSON string",
    ('["--max_steps", 5]', 1): "argument 5 after -- is not a string",
    ("[]", -1): "gpus_requested must be between 1 and 65536, not -1",
    ("[]", 0): "gpus_requested must be between 1 and 65536, not 0",
}


async def _insert_by_hand(db: Database, extra_args: str, gpus: int) -> int:
    """A queued job row written with SQL, not through rlfleet."""
    async with db.transaction() as session:
        job_id = await session.scalar(
            text(
                "INSERT INTO jobs (model, dataset, reward_function, extra_args, gpus_requested,"
                " status) VALUES ('tiny', 'data.jsonl', 'format', CAST(:extra AS jsonb), :gpus,"
                " 'queued') RETURNING id"
            ),
            {"extra": extra_args, "gpus": gpus},
        )
        assert isinstance(job_id, int)
        return job_id


async def test_the_constraints_refuse_malformed_rows(db: Database) -> None:
    """The CHECK constraints keep what the launch relies on out of the table."""
    for extra, gpus in BAD_ROWS:
        with pytest.raises(Exception, match="violates check constraint"):
            await _insert_by_hand(db, extra, gpus)
    with pytest.raises(Exception, match="ck_jobs_status_known"):
        async with db.transaction() as session:
            await session.execute(
                text(
                    "INSERT INTO jobs (model, dataset, reward_function, status) "
                    "VALUES ('m', 'd', 'r', 'bogus')"
                )
            )


async def test_malformed_rows_fail_with_config_error_and_the_batch_goes_on(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, nats: EmbeddedNats, nc: NATS
) -> None:
    """Given job rows written by hand that the launch cannot use (the constraints that
    would refuse them dropped, as on a database of an older release) published in one
    batch with valid jobs, the bad ones fail at once with config_error and a readable
    reason, and the valid ones run."""
    await polled_fleet(sim_fleet, db, 2, 2)
    async with db.transaction() as session:
        for name in ("extra_args_strings", "gpus_positive"):
            await session.execute(
                text(f"ALTER TABLE jobs DROP CONSTRAINT IF EXISTS ck_jobs_{name}")
            )
    bad = {await _insert_by_hand(db, extra, gpus): why for (extra, gpus), why in BAD_ROWS.items()}
    # Admitted by every constraint, but it would set what rlfleet sets itself.
    sneaky = await _insert_by_hand(db, '["--output_dir", "/tmp/elsewhere"]', 1)
    bad[sneaky] = "--output_dir after -- sets --output_dir, which rlfleet sets"
    good = [await new_job(db, extra=("--fake_seconds", "30")) for _ in range(2)]
    ids = sorted([*bad, *good])

    async with running_dispatcher(db, nats.url, batch=32) as dispatcher:
        await publish(nc, *ids)
        for job_id, why in bad.items():
            failed = await wait_status(db, job_id, "failed")
            assert failed.failure_reason == "config_error"
            assert failed.status_reason is not None and why in failed.status_reason
            assert failed.status_reason.startswith("invalid job: ")
        for job_id in good:
            await wait_status(db, job_id, "running")
        assert dispatcher.stats.rejected == len(bad)


DEEP_ROLES = '{"roles": ' + "[" * 3000 + "]" * 3000 + "}"
"""A `roles` value Postgres stores, nested deeper than Python's JSON decoder recurses."""

POISON_ROWS: dict[str, tuple[dict[str, str], str]] = {
    # name → (the columns written by SQL, what the failure reason must say)
    "attempt at the integer limit": (
        {"attempt": str(2**31 - 1)},
        "attempt must be between 0 and 2147483646, not 2147483647",
    ),
    "roles nested 3000 deep": ({"roles": DEEP_ROLES}, "roles: JSON nested deeper than"),
    "env a number": ({"env": "5"}, "env must be a JSON object of strings, not a JSON number"),
    "env an array": ({"env": '["HF_TOKEN"]'}, "env must be a JSON object of strings"),
    "env value not a string": ({"env": '{"A": 5}'}, "env A: the value is not a string"),
    "retry_count at the integer limit": (
        {"retry_count": str(2**31 - 1)},
        "retry_count must be between 0 and 2147483646",
    ),
}


async def _insert_poison(db: Database, columns: dict[str, str]) -> int:
    """A queued job row written with SQL, with `columns` as given (JSON ones as text)."""
    values = {"extra_args": "[]", "env": "{}", "roles": None, "attempt": "0", "retry_count": "0"}
    values.update(columns)
    async with db.transaction() as session:
        job_id = await session.scalar(
            text(
                "INSERT INTO jobs (model, dataset, reward_function, extra_args, env, roles,"
                " attempt, retry_count, gpus_requested, status) VALUES ('tiny', 'data.jsonl',"
                " 'format', CAST(:extra_args AS jsonb), CAST(:env AS jsonb),"
                " CAST(:roles AS jsonb), CAST(:attempt AS integer),"
                " CAST(:retry_count AS integer), 1, 'queued') RETURNING id"
            ),
            values,
        )
        assert isinstance(job_id, int)
        return job_id


@pytest.mark.slow
async def test_poison_rows_fail_their_own_jobs_once_and_the_batch_runs(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, nats: EmbeddedNats, nc: NATS
) -> None:
    """Given queued rows written by hand that no constraint refuses, an attempt at the
    integer limit (the claim's `attempt + 1` would overflow), roles nested 3,000 deep
    (deeper than Python's JSON decoder recurses) and an env that is not an object of
    strings, published in one batch with valid jobs and published again: each bad row
    fails its own job once, with config_error and a reason, and the valid jobs of the
    same batch run."""
    await polled_fleet(sim_fleet, db, 2, 2)
    bad = {await _insert_poison(db, cols): why for cols, why in POISON_ROWS.values()}
    good = [await new_job(db, extra=("--fake_seconds", "30")) for _ in range(2)]
    ids = sorted([*bad, *good])

    async with running_dispatcher(db, nats.url, batch=32) as dispatcher:
        await publish(nc, *ids)
        for job_id in good:
            await wait_status(db, job_id, "running")
        for job_id, why in bad.items():
            failed = await wait_status(db, job_id, "failed")
            assert failed.failure_reason == "config_error"
            assert failed.status_reason is not None, job_id
            assert failed.status_reason.startswith("invalid job: "), failed.status_reason
            assert why in failed.status_reason, failed.status_reason
        await publish(nc, *bad)  # delivered again: nothing more happens to them
        await wait_for(lambda: dispatcher.stats.skipped >= len(bad))
        assert dispatcher.stats.rejected == len(bad)
    async with db.transaction() as session:
        moves = await session.execute(
            text(
                "SELECT job_id, count(*) FROM job_events WHERE to_status = 'failed'"
                " AND job_id = ANY(:ids) GROUP BY job_id"
            ),
            {"ids": list(bad)},
        )
        assert dict(moves.all()) == dict.fromkeys(bad, 1)


async def wait_for(condition: Callable[[], bool], timeout: float = 20) -> None:
    """Poll `condition` until it holds (or fail after `timeout` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def test_listings_show_poison_rows_without_crashing(db: Database, database_url: str) -> None:
    """Given rows whose env is a number or an array and whose JSON columns are nested
    deeper than Python's decoder recurses (their constraints dropped, as on an older
    database), the listing (`job list` on the command line's own connection and through
    the daemons' sessions, which the dashboard's /queue uses) and `job show` show every
    job: an env that is not an object has no keys, never its values, and a JSON value
    that cannot be read shows as null."""
    async with db.transaction() as session:
        await session.execute(
            text("ALTER TABLE jobs DROP CONSTRAINT IF EXISTS ck_jobs_extra_args_strings")
        )
    number = await _insert_poison(db, {"env": "5"})
    array = await _insert_poison(db, {"env": '["HF_TOKEN", "hunter2"]'})
    deep = await _insert_poison(db, {"roles": DEEP_ROLES, "extra_args": "[" * 3000 + "]" * 3000})
    fine = await new_job(db, env=(("HF_TOKEN", "x"),))
    expected_keys = {number: [], array: [], deep: [], fine: ["HF_TOKEN"]}

    pg = PgDatabase(database_url)
    try:
        async with pg.sql_transaction() as tx:
            cli_rows = await jobstore.list_jobs(tx)
    finally:
        await pg.dispose()
    async with db.transaction() as session:
        orm_rows = await list_jobs(session)
    for rows in (cli_rows, orm_rows):
        assert {row["id"]: row["env_keys"] for row in rows} == expected_keys
        by_id = {row["id"]: row for row in rows}
        assert by_id[deep]["extra_args"] is None
        assert by_id[deep]["group"] is True
        json.dumps(rows, default=str)  # what --json and the API print
    for job_id, keys in expected_keys.items():
        async with db.transaction() as session:
            shown = await show_job(session, job_id)
        assert shown["env_keys"] == keys
        json.dumps(shown, default=str)
    assert shown["roles"] == []  # `fine` is no group
