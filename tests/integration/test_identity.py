"""Invariant 6 with every real piece (Postgres, NATS, the SSH test fleet, the dispatcher,
the poller, the requeue manager): a result belongs to the run that produced it.

- A recreated database (a new installation) reuses job ids on the same VM accounts: every
  new job really runs, none adopts what the old installation left there.
- A job cancelled, or its log read, from a shell whose $HOME differs from the daemons' acts
  on the directory the launch recorded.
- One success is enough: an attempt given up for lost that turns out to have exited 0
  completes its job once, and the newer attempt is stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import psycopg
import pytest
from psycopg import sql
from sqlalchemy import func, select, update

from scheduler.control import cancel_job
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats, EmbeddedPostgres
from scheduler.fleet import VMSpec, add_vm
from scheduler.gpu_poller import GpuPoller
from scheduler.job_logs import stream_log
from scheduler.migrate import upgrade
from scheduler.models import GPU, VM, Job, JobEvent, Leftover
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.transport import Transport
from tests.backdate import age_outages
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    alive,
    attempt_dirs,
    installation,
    job_row,
    new_job,
    publish,
    running_dispatcher,
    sweep_until,
    wait_file,
    wait_status,
    write_fake_python,
)

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, node_lost_timeout_s=2.0, recheck_after_s=0.5)
FINAL = {"completed", "failed", "cancelled"}


def drop_database(postgres: EmbeddedPostgres, name: str) -> None:
    """Drop the database `name` if it exists (its connections are ended)."""
    stmt = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(
        host="127.0.0.1", port=postgres.port, user=postgres.user, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(stmt)


def recreate_database(postgres: EmbeddedPostgres, name: str) -> str:
    """Drop `name` if it exists, create it empty and migrate it: a new installation."""
    drop_database(postgres, name)
    url = postgres.create_database(name)
    upgrade(url)
    return url


async def run_round(
    url: str,
    fleet: SimFleet,
    nats: EmbeddedNats,
    transport: Transport,
    python: str,
    tag: str,
    exit_code: int,
) -> tuple[str, list[Job]]:
    """On the database at `url`: register the fleet, run three one-GPU jobs tagged `tag`
    that exit with `exit_code`, sweep until all are final; the installation and the jobs."""
    db = Database(url)
    try:
        await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=python)
        poller = GpuPoller(db, transport)
        await poller.sweep()
        extra = ("--run_tag", tag, "--fake_exit", str(exit_code))
        job_ids = [await new_job(db, 1, extra) for _ in range(3)]
        async with running_dispatcher(db, nats.url, transport=transport):
            nc = await nats_client.connect(nats.url)
            await publish(nc, *job_ids)
            await nc.close()
            deadline = time.monotonic() + 60
            while True:
                await poller.sweep()
                jobs = [await job_row(db, j) for j in job_ids]
                if all(j.status in FINAL for j in jobs):
                    break
                assert time.monotonic() < deadline, [(j.id, j.status) for j in jobs]
                await asyncio.sleep(0.2)
        return await installation(db), jobs
    finally:
        await db.dispose()


async def test_a_recreated_database_never_adopts_the_old_installations_leftovers(
    sim_fleet: FleetFactory,
    postgres: EmbeddedPostgres,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Given three jobs that ran and exited 3 on one VM account, when the database is
    dropped and recreated and three new jobs (the same ids) run on the same account, then
    each new one really runs (its own log says its tag) and completes with its own exit 0;
    the old installation's files are left as they were."""
    fleet = await sim_fleet(1, gpus_per_vm=3)
    home, python = fleet[0].home, write_fake_python(tmp_path)
    name = f"identity_{id(tmp_path)}"
    url = recreate_database(postgres, name)
    old, first = await run_round(url, fleet, nats, transport, python, "first", 3)
    assert [(j.status, j.exit_code) for j in first] == [("failed", 3)] * 3

    url = recreate_database(postgres, name)
    new, second = await run_round(url, fleet, nats, transport, python, "second", 0)
    assert new != old, "a new database is a new installation"
    assert [j.id for j in second] == [j.id for j in first]
    for job in second:
        assert (job.status, job.exit_code, job.completed_attempt) == ("completed", 0, 1)
        assert job.attempt_dir is not None and new in job.attempt_dir
        log = (Path(job.attempt_dir) / "train.log").read_text()
        assert "'--run_tag', 'second'" in log and "'first'" not in log
        assert (Path(job.attempt_dir) / "exit_code").read_text().strip() == "0"
        [old_dir] = attempt_dirs(home, old, job.id, 1)
        assert (old_dir / "exit_code").read_text().strip() == "3"
        assert "'--run_tag', 'first'" in (old_dir / "train.log").read_text()
        assert (home / ".rlfleet" / new / "outputs" / str(job.id)).is_dir()
    drop_database(postgres, name)


async def test_cancel_and_logs_from_another_home_act_on_the_recorded_directory(
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a job running on a `local` VM launched by daemons whose $HOME is one
    directory, when `job logs` and `job cancel` run from a shell whose $HOME is another,
    then the log is read and the process is terminated in the recorded directory: never
    "stopped before it started", and no `fenced` mark lands in the caller's home."""
    daemon_home, user_home = tmp_path / "daemon-home", tmp_path / "user-home"
    daemon_home.mkdir()
    user_home.mkdir()
    monkeypatch.setenv("HOME", str(daemon_home))
    async with db.transaction() as session:
        vm = await add_vm(
            session,
            VMSpec(
                name="here",
                host="localhost",
                transport="local",
                python=write_fake_python(tmp_path),
                entrypoint=str(FAKE_TRAIN),
            ),
        )
        vm_id = vm.id
    async with db.transaction() as session:
        session.add(GPU(vm_id=vm_id, index=0, uuid="GPU-here-0"))
        await session.execute(update(VM).where(VM.id == vm_id).values(status="healthy"))
    job_id = await new_job(db, 1, ("--fake_seconds", "300"))
    async with running_dispatcher(db, nats.url, transport=transport):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        job = await wait_status(db, job_id, "running")
    assert job.attempt_dir is not None and job.attempt_dir.startswith(str(daemon_home))
    await wait_file(Path(job.attempt_dir) / "train.log", needle="fake_train: args=")
    assert job.remote_pid is not None and alive(job.remote_pid)

    monkeypatch.setenv("HOME", str(user_home))
    out: list[bytes] = []
    await stream_log(db, transport, job_id, out.append)
    assert b"fake_train: args=" in b"".join(out)
    result = await cancel_job(db, transport, job_id, actor="test", grace_s=5)
    assert (result.kill, result.dead) == ("terminated", True)
    for _ in range(100):
        if not alive(job.remote_pid):
            break
        await asyncio.sleep(0.05)
    assert not alive(job.remote_pid)
    assert not (user_home / ".rlfleet").exists()


async def test_one_success_is_enough(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Given a job whose VM went silent, its attempt given up for lost (node_lost) and
    retried on another VM, when the silent VM answers again and its attempt turns out to
    have exited 0 with its output saved while the retry still runs, then the job is
    completed once, from that first attempt (its row and event name the attempt, VM and
    directory), and the newer attempt is killed and its GPU freed."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    by_id = {vm_id: fleet.by_name(name) for name, vm_id in ids.items()}
    names = {vm_id: name for name, vm_id in ids.items()}
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    extra = ("--fake_seconds", "6", "--fake_retry_seconds", "300")
    job_id = await new_job(db, 1, extra, max_retries=0)
    nc = await nats_client.connect(nats.url)
    requeue = RequeueManager(db, NatsPublisher(nc), transport, CONFIG)
    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            await requeue.tick()  # announces the job
            first = await wait_status(db, job_id, "running")
            assert first.attempt_dir is not None and first.remote_pid is not None
            lost_vm = by_id[first.vm_id]
            await lost_vm.stop()  # silent; its process lives on
            await sweep_until(poller, db, first.vm_id, "unreachable")
            await age_outages(db, CONFIG.node_lost_timeout_s + 1)
            report = await requeue.tick()
            assert report.node_lost == [job_id] and report.retried == [job_id]
            second = await wait_status(db, job_id, "running")
            assert second.vm_id != first.vm_id and second.attempt == 2
            assert second.remote_pid is not None

            # Meanwhile, the partitioned attempt finishes its work.
            code = await wait_file(Path(first.attempt_dir) / "exit_code", timeout=30)
            assert code.strip() == "0"
            await lost_vm.start()
            await sweep_until(poller, db, first.vm_id, "healthy")
            report = await requeue.tick()
            assert report.killed == [job_id]
            job = await job_row(db, job_id)
            assert (job.status, job.exit_code, job.failure_reason) == ("completed", 0, None)
            assert (job.completed_attempt, job.attempt) == (1, 2)
            assert (job.vm_id, job.attempt_dir) == (first.vm_id, first.attempt_dir)
            outputs = lost_vm.home / ".rlfleet" / await installation(db) / "outputs"
            assert (outputs / str(job_id)).is_dir()

            # The newer attempt is stopped by the next tick, and its GPU freed.
            report = await requeue.tick()
            assert report.killed == [job_id]
            for _ in range(100):
                if not alive(second.remote_pid):
                    break
                await asyncio.sleep(0.05)
            assert not alive(second.remote_pid)
            await poller.sweep()
            await poller.sweep()
    finally:
        await nc.close()
    async with db.transaction() as session:
        events = (
            await session.execute(
                select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            )
        ).scalars()
        completed = [e for e in events if e.to_status == "completed"]
        assert len(completed) == 1
        reason = completed[0].reason or ""
        assert f"attempt 1 on {names[first.vm_id]}" in reason and first.attempt_dir in reason
        assert "attempt 2 stopped" in reason
        assert await session.scalar(select(func.count()).where(GPU.job_id.is_not(None))) == 0
        open_rows = await session.scalar(
            select(func.count()).select_from(Leftover).where(Leftover.killed_at.is_(None))
        )
        assert open_rows == 0
        superseded = (
            await session.execute(select(Leftover).where(Leftover.attempt == 2))
        ).scalar_one()
        assert (superseded.reason, superseded.vm_id) == ("superseded", second.vm_id)
