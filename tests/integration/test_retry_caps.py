"""A job's own files cannot buy it retries (issue 29, point 7), on the SSH test fleet with
the real poller, dispatcher, requeue manager, NATS and Postgres: a garbage fence note beside
an exit 0 is the job's failure, counted; a store that never answers ends the job after the
cap on uncounted retries, with a final reason that says so, and the password in its
endpoint URL reaches neither the job's row, its events nor `job show` (point 8)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy import select

from scheduler.control import job_details
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.models import Job, JobEvent
from scheduler.requeue import RequeueConfig
from scheduler.retry import RetryPolicy
from tests.fleet import SimFleet
from tests.workloads.support import FAKE_TRAIN, daemons, job_row, new_job

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CAP = 3
CONFIG = RequeueConfig(
    interval_s=0.2,
    recheck_after_s=0.3,
    policy=RetryPolicy(base_delay_s=0.1, max_delay_s=0.2, jitter=0.0, uncounted_limit=CAP),
)
SECRET = "s3cretPW-never-shown"


async def given_up(db: Database, job_id: int, timeout: float) -> Job:
    deadline = time.monotonic() + timeout
    while (job := await job_row(db, job_id)).retry_decision != "give_up" or job.status != "failed":
        assert job.status != "completed", job.status_reason
        assert time.monotonic() < deadline, (job.status, job.attempt, job.status_reason)
        await asyncio.sleep(0.1)
    return job


async def events(db: Database, job_id: int) -> list[str]:
    async with db.transaction() as session:
        rows = await session.scalars(
            select(JobEvent.reason).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        )
        return [r or "" for r in rows]


async def test_a_garbage_fence_note_beside_exit_0_is_the_jobs_failure_counted(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a job that writes 1 MB of garbage into its attempt's `fenced_reason` and exits
    0, with one retry: it is not taken for a lost node (uncounted, retried at once, over and
    over) but fails as `bad_control_file`, counted: retried once, then given up."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    job_id = await new_job(db, 1, ("--fake_fence_note", str(1 << 20)), max_retries=1)
    async with daemons(db, nats.url, CONFIG):
        job = await given_up(db, job_id, 90)
    assert (job.failure_reason, job.attempt, job.retry_count) == ("bad_control_file", 2, 1), (
        job.status_reason
    )
    assert job.machine_faults == 0 and not job.uncounted_retries
    assert not any("node_lost" in r for r in await events(db, job_id))


async def test_a_store_that_never_answers_ends_the_job_after_the_cap(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a job whose store never answers (its endpoint, with a password in its URL, is a
    closed port): `store_error` is retried uncounted `CAP` times, then the job fails for
    good saying how many uncounted retries of which class, and the last failure; the
    password appears nowhere in its row, its events or `job show`."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    aws = fleet[0].home / ".aws"
    aws.mkdir(parents=True, exist_ok=True)
    (aws / "credentials").write_text(
        "[default]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = " + "k" * 40 + "\n"
    )
    (aws / "config").write_text(
        f"[default]\nregion = us-east-1\nendpoint_url = http://rl:{SECRET}@127.0.0.1:9\n"
    )
    job_id = await new_job(db, 1, store="s3://bucket/runs", max_retries=0)
    async with daemons(db, nats.url, CONFIG) as transport:
        job = await given_up(db, job_id, 150)
        shown = await job_details(db, job_id, transport, events_limit=100)
    assert job.failure_reason == "store_error" and job.attempt == CAP + 1, job.status_reason
    assert job.retry_count == 0 and job.uncounted_retries == {"store_error": CAP}
    why = job.status_reason or ""
    tally = f"gave up after {CAP} uncounted retries (store_error ×{CAP}): last: "
    assert why.startswith(tally), why
    assert "store_error" in why.split("last: ", 1)[1]
    row = {c.name: getattr(job, c.name) for c in Job.__table__.columns}
    for text in (json.dumps(row, default=str), json.dumps(shown, default=str)):
        assert SECRET not in text
    assert not any(SECRET in r for r in await events(db, job_id))
    assert any("127.0.0.1:9" in r for r in await events(db, job_id))  # the URL is still shown
