"""Progress-aware liveness on the real fleet (SSH servers, simulated nvidia-smi), poller,
dispatcher, requeue manager, NATS and Postgres: a trainer that stops advancing is stopped
within its hang timeout and one poll, its diagnostics kept, and it resumes from its
checkpoint on another VM; a slow trainer is never stopped; one that never reports
progress is stopped at its startup timeout; one that hangs every time ends `failed`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.models import VM, Job, JobDiagnostics, JobEvent, Leftover
from scheduler.requeue import RequeueConfig
from scheduler.retry import RetryPolicy
from tests.backdate import age_progress
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    RLFLEET,
    attempt_dirs,
    daemons,
    installation,
    job_row,
    new_job,
    read_records,
    wait_status,
)

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(
    interval_s=0.2,
    recheck_after_s=0.3,
    policy=RetryPolicy(base_delay_s=0.1, jitter=0.0),
)
POLL_S = 0.2
CAPTURE_SLACK_S = 4.0
"""What the hang check may take beyond the timeout and one poll (capture, load)."""
"""The poll interval of `daemons()`."""


def rlfleet(db: Database, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI, as a user runs it."""
    env = dict(os.environ, RLFLEET_DATABASE_URL=db.url)
    return subprocess.run(
        [str(RLFLEET), *args], env=env, capture_output=True, text=True, timeout=60
    )


async def set_draining(db: Database, name: str, draining: bool) -> None:
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.name == name).values(draining=draining))


async def wait_step(db: Database, job_id: int, step: int, timeout: float = 30) -> Job:
    """The job once the poller has recorded `step` of its current attempt."""
    deadline = time.monotonic() + timeout
    while (job := await job_row(db, job_id)).progress_step != step:
        assert time.monotonic() < deadline, f"job {job_id} at step {job.progress_step}"
        await asyncio.sleep(0.05)
    return job


async def failed_events(db: Database, job_id: int) -> list[JobEvent]:
    async with db.transaction() as session:
        rows = await session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.to_status == "failed")
            .order_by(JobEvent.id)
        )
        return list(rows)


async def diagnostics(db: Database, job_id: int) -> list[JobDiagnostics]:
    async with db.transaction() as session:
        rows = await session.scalars(
            select(JobDiagnostics)
            .where(JobDiagnostics.job_id == job_id)
            .order_by(JobDiagnostics.attempt)
        )
        return list(rows)


async def hung_trainer_proof(
    db: Database, nats_url: str, fleet: Any, output_dir: Path, config: Any, *, timeout: float
) -> tuple[int, Any, Any, Any, float]:
    """The hung-trainer proof on `fleet` (the in-process or the OpenSSH one): vm0's trainer
    hangs after step 3 at 100 % and 80/400 W; checked: one `hung` event, found within the
    timeout plus one poll (and the capture), the retry on vm1 completing with one retry
    used, and the diagnostics kept. Returns the job id, the finished job, its diagnostics
    when step 3 was first read and the seconds from then to the event."""
    fleet.by_name("vm0").set_busy_power(0, 80.0)  # 100 % busy at 80/400 W
    await set_draining(db, "vm1", True)
    args: tuple[str, ...] = ("--fake_hang_at", "3", "--fake_hang_once", "--fake_checkpoints")
    args += ("--fake_step_seconds", "0.2")
    async with daemons(db, nats_url, config):
        job_id = await new_job(
            db, 1, args, hang_timeout_s=10, output_dir=str(output_dir), max_retries=2
        )
        job = await wait_step(db, job_id, 3)
        assert job.status == "running" and job.attempt == 1
        seen_at = job.progress_changed_at
        assert seen_at is not None
        await set_draining(db, "vm1", False)
        await set_draining(db, "vm0", True)
        done = await wait_status(db, job_id, "completed", timeout=timeout)

    events = await failed_events(db, job_id)
    assert len(events) == 1 and events[0].attempt == 1, [e.reason for e in events]
    reason = events[0].reason or ""
    assert reason.startswith("hung: step 3 unchanged for 1"), reason
    assert "80/400 W" in reason
    detected_s = (events[0].created_at - seen_at).total_seconds()
    # Within the timeout plus one poll, plus the capture (nvidia-smi and py-spy over SSH:
    # under a second on an idle machine, a few on a loaded 2-core CI runner).
    assert 10 <= detected_s <= 10 + POLL_S + CAPTURE_SLACK_S, detected_s
    assert (done.attempt, done.retry_count) == (2, 1)
    (diag,) = await diagnostics(db, job_id)
    assert (diag.attempt, diag.vm_name) == (1, "vm0")
    assert diag.reason == events[0].reason
    gpu = fleet.by_name("vm0").gpu_uuids[0]
    assert f"GPUs of the attempt: {gpu}\n" in diag.content
    assert f"== nvidia-smi -i {gpu}\n" in diag.content
    for needle in ("fake_train: step 3", "waiting for a peer", "== process"):
        assert needle in diag.content, (needle, diag.content[:3000])
    return job_id, done, diag, seen_at, detected_s


async def test_a_hung_trainer_is_stopped_diagnosed_and_resumes_elsewhere(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a trainer that checkpoints each step and stops advancing after step 3 (its
    process alive, its GPU 100 % busy at low power: a hung collective) with a 10 s hang
    timeout, when it runs on vm0, then within 10 s and one poll of the poller first
    reading step 3 it is failed as `hung` (by the database's clock), its diagnostics
    (each process's stacks by py-spy, the GPU view, the log tail) are kept in the
    database and in the attempt directory, its process is killed, and the retry, on vm1,
    resumes from checkpoint 3 and completes, with one retry used."""
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("RLFLEET_FAKE_RECORD", str(records))
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    job_id, done, diag, _seen_at, detected_s = await hung_trainer_proof(
        db, nats.url, fleet, tmp_path / "shared-outputs", CONFIG, timeout=60
    )
    print(f"hang detected {detected_s:.2f}s after step 3 was first read (timeout 10s)")
    # py-spy's dump of the trainer: its Python stack, down to the sleep it hangs in.
    assert "hang (" in diag.content and "fake_train.py:" in diag.content, diag.content[-3000:]
    home = fleet.by_name("vm0").home
    (first,) = attempt_dirs(home, await installation(db), job_id, 1)
    assert (first / "diagnostics.txt").read_text() == diag.content + "\n" or (
        diag.content in (first / "diagnostics.txt").read_text()
    )
    runs = read_records(records)
    hung = next(r for r in runs if r["event"] == "hang")
    resumed = [r for r in runs if r["event"] == "resumed"]
    assert [(r["vm"], r["attempt"], r["from_step"]) for r in resumed] == [("vm1", "2", 3)]
    async with db.transaction() as session:
        (left,) = await session.scalars(select(Leftover).where(Leftover.job_id == job_id))
    assert left.killed_at is not None and left.reason == "hung"
    assert not Path(f"/proc/{hung['pid']}").exists(), "the hung trainer still runs"

    # `job logs --diagnostics` shows them (the newest attempt that has some by default).
    shown = rlfleet(db, "job", "logs", str(job_id), "--diagnostics")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"attempt 1 on vm0, captured {diag.captured_at}: hung: ")
    assert "fake_train.py:" in shown.stdout and "== nvidia-smi" in shown.stdout
    none = rlfleet(db, "job", "logs", str(job_id), "--diagnostics", "--attempt", "2")
    assert none.returncode == 2 and "attempt 2 of job" in none.stderr, none
    assert len(none.stderr.strip().splitlines()) == 1


async def test_a_slow_trainer_is_never_stopped(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a trainer taking 5 s per step, its GPU idle-looking (80 W) so that only the
    progress decides, with a 10 s hang timeout (twice a step), when it runs its 5 steps,
    then it completes on its first attempt: no false stop."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    fleet.by_name("vm0").set_busy_power(0, 80.0)
    async with daemons(db, nats.url, CONFIG):
        job_id = await new_job(db, 1, ("--fake_step_seconds", "5"), hang_timeout_s=10)
        done = await wait_status(db, job_id, {"completed", "failed"}, timeout=90)
    assert done.status == "completed", done.status_reason
    assert done.attempt == 1 and not await failed_events(db, job_id)


async def test_a_trainer_that_never_reports_progress_fails_its_startup_timeout(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a trainer that never writes progress.json and a job with a 30 s startup
    timeout and no retries, when its launch is aged past 30 s, then it fails as
    `startup_timeout` with its diagnostics kept, and ends `failed` (no retry left)."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    async with daemons(db, nats.url, CONFIG):
        job_id = await new_job(db, 1, ("--fake_hang_at", "0"), startup_timeout_s=30, max_retries=0)
        await wait_status(db, job_id, "running")
        await asyncio.sleep(1.0)  # polls see it running, with no progress
        assert (await job_row(db, job_id)).status == "running"
        await age_progress(db, job_id, 31)
        job = await wait_status(db, job_id, "failed", timeout=30)
    assert job.failure_reason == "startup_timeout"
    assert "no progress reported" in ((await failed_events(db, job_id))[0].reason or "")
    (diag,) = await diagnostics(db, job_id)
    assert "waiting for a peer" in diag.content


async def test_a_trainer_that_hangs_every_time_ends_failed(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a trainer that hangs after step 1 on every attempt and a job with one retry,
    when each hang is aged past the 10 s timeout, then both attempts fail as `hung` and the
    job ends `failed` with its retries used up, not looping."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    args = ("--fake_hang_at", "1", "--fake_step_seconds", "0.1")
    async with daemons(db, nats.url, CONFIG):
        job_id = await new_job(db, 1, args, hang_timeout_s=10, max_retries=1)
        for attempt in (1, 2):
            deadline = time.monotonic() + 30
            while True:
                job = await job_row(db, job_id)
                if job.attempt == attempt and job.progress_attempt == attempt:
                    break
                assert time.monotonic() < deadline, (job.status, job.attempt)
                await asyncio.sleep(0.05)
            await age_progress(db, job_id, 25)  # past twice the timeout: GPU signal aside
            await wait_status(db, job_id, "failed", timeout=30)
        deadline = time.monotonic() + 30
        while (job := await job_row(db, job_id)).retry_decision != "give_up":
            assert time.monotonic() < deadline, (job.status, job.retry_decision)
            await asyncio.sleep(0.1)
    assert (job.status, job.failure_reason, job.retry_count) == ("failed", "hung", 1)
    assert [e.attempt for e in await failed_events(db, job_id)] == [1, 2]
