"""`rlfleet job cancel | retry | logs | show` against a running job on the test fleet:
the real CLI as a subprocess, real Postgres, NATS and SSH."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import nats as nats_client
import pytest
from sqlalchemy import func, select

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpus import release_in_session
from scheduler.jobs import transition
from scheduler.models import GPU
from scheduler.states import JobStatus
from tests.fleet import SimFleet
from tests.workloads.support import (
    RLFLEET,
    job_attempt_dir,
    job_row,
    new_job,
    polled_fleet,
    publish,
    running_dispatcher,
    wait_file,
    wait_status,
)


async def rlfleet(db: Database, nats: EmbeddedNats, *args: str) -> tuple[int, str, str]:
    """Run the real CLI; the event loop keeps serving the simulated VMs meanwhile."""
    env = dict(os.environ, RLFLEET_DATABASE_URL=db.url, RLFLEET_NATS_URL=nats.url)
    proc = await asyncio.create_subprocess_exec(
        str(RLFLEET),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.slow
async def test_cancel_kills_a_running_job_and_frees_its_gpus(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, nats: EmbeddedNats
) -> None:
    """Given a running job, `job cancel` kills its process group on the VM, frees its GPUs
    and makes it cancelled; cancelling it again is exit 2 with one line."""
    fleet = (await polled_fleet(sim_fleet, db, 1, 2))[0]
    job_id = await new_job(db, 2, ("--fake_seconds", "60"))
    async with running_dispatcher(db, nats.url):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        job = await wait_status(db, job_id, "running")
    assert job.remote_pid in fleet[0].processes()

    code, out, err = await rlfleet(db, nats, "job", "cancel", str(job_id), "--grace", "3")
    assert (code, out.strip()) == (0, f"job {job_id} cancelled (process terminated)"), err
    job = await job_row(db, job_id)
    assert job.status == "cancelled" and job.finished_at is not None
    assert job.remote_pid not in fleet[0].processes()
    d = await job_attempt_dir(db, job_id, fleet[0].home)
    assert (await wait_file(d / "exit_code")).strip() == "143"
    async with db.transaction() as session:
        assert await session.scalar(select(func.count()).where(GPU.job_id.is_not(None))) == 0

    code, out, err = await rlfleet(db, nats, "job", "cancel", str(job_id))
    assert code == 2 and err.strip().splitlines() == [
        f"Error: job {job_id} is already cancelled; there is nothing to cancel"
    ]


@pytest.mark.slow
async def test_cancel_a_queued_job_and_an_unknown_one(db: Database, nats: EmbeddedNats) -> None:
    """A queued job is cancelled without any VM; an unknown id is exit 2."""
    job_id = await new_job(db)
    code, out, _ = await rlfleet(db, nats, "job", "cancel", str(job_id))
    assert (code, out.strip()) == (0, f"job {job_id} cancelled")
    assert (await job_row(db, job_id)).status == "cancelled"
    code, _, err = await rlfleet(db, nats, "job", "cancel", "424242")
    assert code == 2 and err.strip() == "Error: no job with id 424242"


@pytest.mark.slow
async def test_cancel_a_failed_job_stops_its_retries(db: Database, nats: EmbeddedNats) -> None:
    """A failed job waiting for its retry is cancelled (exit 0, one line, no traceback),
    and the requeue manager's later retry loses the guarded move."""
    job_id = await new_job(db)
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=JobStatus.QUEUED,
            to=JobStatus.FAILED,
            reason="exit 1",
            actor="test",
            values={"failure_reason": "exit_nonzero", "exit_code": 1},
        )
    code, out, err = await rlfleet(db, nats, "job", "cancel", str(job_id))
    assert (code, out.strip()) == (0, f"job {job_id} cancelled"), err
    assert "Traceback" not in err
    async with db.transaction() as session:
        assert not await transition(
            session,
            job_id,
            expected=JobStatus.FAILED,
            to=JobStatus.QUEUED,
            reason="retry",
            actor="requeue",
        )
    job = await job_row(db, job_id)
    assert (job.status, job.next_attempt_at) == ("cancelled", None)


@pytest.mark.slow
async def test_retry_logs_of_every_attempt_and_show(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, nats: EmbeddedNats
) -> None:
    """Given a job whose first attempt fails (a CUDA OOM), `job retry` queues and publishes
    it, the second attempt runs with --resume auto, `job logs` prints each attempt's log,
    `--follow` ends when the job does, and `job show` reports progress from the VM."""
    fleet = (await polled_fleet(sim_fleet, db, 1, 1))[0]
    job_id = await new_job(db, 1, ("--fake_oom_once", "--fake_seconds", "1.5"))
    async with running_dispatcher(db, nats.url):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await wait_status(db, job_id, "running")
        d1 = await job_attempt_dir(db, job_id, fleet[0].home)
        assert (await wait_file(d1 / "exit_code")).strip() == "75"
        # The poller's part, done by hand: the attempt failed and its GPUs are free.
        async with db.transaction() as session:
            assert await transition(
                session,
                job_id,
                expected=JobStatus.RUNNING,
                to=JobStatus.FAILED,
                reason="exit 75",
                actor="test",
                values={"failure_reason": "oom", "exit_code": 75},
            )
            await release_in_session(session, job_id)

        code, _, err = await rlfleet(db, nats, "job", "retry", str(job_id))
        assert code == 0, err
        job = await wait_status(db, job_id, "running")
        assert job.attempt == 2
        follow = asyncio.create_task(rlfleet(db, nats, "job", "logs", str(job_id), "--follow"))
        d2 = await job_attempt_dir(db, job_id, fleet[0].home)
        await wait_file(d2 / "progress.json")
        code, shown, err = await rlfleet(db, nats, "job", "show", str(job_id))
        assert code == 0, err
        assert "progress:" in shown and "/5 (" in shown
        await wait_file(d2 / "exit_code")
        async with db.transaction() as session:
            await transition(
                session,
                job_id,
                expected=JobStatus.RUNNING,
                to=JobStatus.COMPLETED,
                reason="exit 0",
                actor="test",
            )
            await release_in_session(session, job_id)
        code, followed, err = await asyncio.wait_for(follow, 30)
        await nc.close()
    assert code == 0, err
    assert "step 5/5" in followed and "--resume', 'auto'" in followed

    code, first, _ = await rlfleet(db, nats, "job", "logs", str(job_id), "--attempt", "1")
    assert code == 0 and "CUDA out of memory" in first
    code, _, err = await rlfleet(db, nats, "job", "retry", str(job_id))
    assert code == 2 and err.strip() == (
        f"Error: job {job_id} is completed; only a failed job can be retried"
    )
    code, _, err = await rlfleet(db, nats, "job", "logs", str(job_id), "--attempt", "3")
    assert code == 2 and "there is no attempt 3" in err

    # The VM goes away: show still works and says so in one line.
    await fleet[0].stop()
    code, shown, err = await rlfleet(db, nats, "job", "show", str(job_id))
    assert code == 0, err
    assert [line for line in shown.splitlines() if line.startswith("progress:")][0].startswith(
        "progress:         unavailable (cannot read progress.json"
    )
