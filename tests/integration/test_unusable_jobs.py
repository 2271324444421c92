"""Jobs that can never run do not stall the queue, and a job row the launch cannot use
fails its job, not its batch: real Postgres, real NATS, a real SSH fleet."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import nats as nats_client
import pytest
from nats.aio.client import Client as NATS
from sqlalchemy import text, update

from scheduler import bus, fleet
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.models import GPU
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
    ("[]", -1): "gpus_requested must be between 1 and 1024, not -1",
    ("[]", 0): "gpus_requested must be between 1 and 1024, not 0",
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
