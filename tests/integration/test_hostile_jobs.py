"""Whatever a job writes or runs costs only that job (docs/invariants.md, invariant 9), with
the real fleet (SSH servers, simulated GPUs), poller, dispatcher, requeue manager, NATS and
Postgres, and once against OpenSSH's own sshd: hostile files in an attempt directory, a job
environment naming the wrapper's variables or breaking PATH, an exit code forged by a
neighbour, a child that left the attempt's process group."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from scheduler.control import cancel_job, job_details
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.fleet import VMSpec, add_vm
from scheduler.gpu_poller import GpuPoller
from scheduler.jobs import JobSpec, insert_job
from scheduler.models import GPU, VM, Job, JobEvent
from scheduler.remote.layout import default_output_dir, new_token
from scheduler.requeue import RequeueConfig
from scheduler.retry import RetryPolicy
from scheduler.states import JobStatus
from scheduler.transport import SSHTransport, VMTarget
from tests.fleet import SimFleet
from tests.integration.test_sshd import RealSshd, sshd  # noqa: F401 - the fixture
from tests.workloads.fake_train import SPARSE_LOG_BYTES
from tests.workloads.support import (
    FAKE_TRAIN,
    alive,
    daemons,
    installation,
    job_attempt_dir,
    job_row,
    launch_on,
    new_job,
    wait_file,
    wait_status,
    write_fake_python,
)

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(
    interval_s=0.2, recheck_after_s=0.3, policy=RetryPolicy(base_delay_s=0.2, jitter=0.0)
)


class VMWatch:
    """Samples a VM row until stopped and keeps every sample that was not a healthy VM
    answering its polls: the VM must stay healthy throughout, not only at the end."""

    def __init__(self, db: Database, vm_id: int) -> None:
        self.db = db
        self.vm_id = vm_id
        self.bad: list[tuple[str, int, str | None, str | None]] = []
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            async with self.db.transaction() as session:
                vm = await session.get(VM, self.vm_id, populate_existing=True)
                assert vm is not None
                sample = (vm.status, vm.consecutive_failures, vm.last_error, vm.launch_error)
            self.samples += 1
            if sample[:2] != ("healthy", 0) or sample[2:] != (None, None):
                self.bad.append(sample)
            await asyncio.sleep(0.05)

    def __enter__(self) -> VMWatch:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def wait_vm_healthy(db: Database, vm_id: int, timeout: float = 30) -> None:
    """Wait for the first polls to mark the VM healthy."""
    deadline = time.monotonic() + timeout
    while True:
        async with db.transaction() as session:
            if await session.scalar(select(VM.status).where(VM.id == vm_id)) == "healthy":
                return
        assert time.monotonic() < deadline, "the VM never became healthy"
        await asyncio.sleep(0.1)


async def reasons(db: Database, job_id: int) -> list[str]:
    """The reasons of every event of the job, in order."""
    async with db.transaction() as session:
        rows = await session.scalars(
            select(JobEvent.reason).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        )
        return [r or "" for r in rows]


async def test_a_job_writing_hostile_files_costs_its_neighbour_and_its_vm_nothing(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given two jobs on one VM account, one of which writes into its attempt directory a
    progress.json nested 2,040 deep, one with a 5,000-digit number, invalid UTF-8, NaN,
    binary, then garbage, a 30-digit number and a forged 0 into its exit_code while it
    runs, and last makes its train.log a sparse 100 GB file without a newline: both run to
    completion on their first attempt (no node_lost, no retry), the hostile one with its
    own exit code once it really ended, and the VM stays healthy at every sample; `job
    show` of the hostile job says its progress cannot be read, without a traceback, and
    what it returns serves as strict JSON."""
    fleet = await sim_fleet(1, gpus_per_vm=2)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    vm_id = ids["vm0"]
    async with daemons(db, nats.url, CONFIG) as transport:
        await wait_vm_healthy(db, vm_id)
        with VMWatch(db, vm_id) as watch:
            hostile = await new_job(db, 1, ("--fake_hostile", "--fake_seconds", "5"), max_retries=0)
            neighbour = await new_job(db, 1, ("--fake_seconds", "7"), max_retries=0)
            done = [
                await wait_status(db, j, {"completed", "failed"}, 90) for j in (hostile, neighbour)
            ]
        assert watch.samples > 20 and watch.bad == [], watch.bad[:5]
        for job in done:
            assert (job.status, job.attempt, job.retry_count) == ("completed", 1, 0), (
                job.id,
                job.status,
                job.status_reason,
            )
            assert job.exit_code == 0 and job.vm_id == vm_id
            assert not any("node_lost" in r for r in await reasons(db, job.id))
        log = await job_attempt_dir(db, hostile, fleet[0].home) / "train.log"
        assert log.stat().st_size > SPARSE_LOG_BYTES, "the hostile job never made its log huge"

        shown = await job_details(db, hostile, transport)
    assert shown["progress"] is None and "not readable" in shown["progress_error"]
    json.dumps(shown, allow_nan=False, default=str)


async def test_the_wrappers_variables_in_a_jobs_env_change_nothing_but_that_job(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given jobs on one VM whose env names the wrapper's shell variables (`d` is where it
    writes the exit code; `rlfleet_sig`, `rlfleet_wd` are refused at submit, so written
    into the rows by hand), a job whose PATH has no python, and a job whose training exits
    127: the `d` job completes on its first attempt; the hand-written ones either complete
    (their refused names left out) or fail once as a row that cannot be launched, never
    `killed`, and the stranger `rlfleet_wd` named is never signalled; the last two fail as
    `exit_nonzero` 127, counted against their retries (retried once, then given up); and
    the VM stays healthy throughout, with no launch error."""
    fleet = await sim_fleet(1, gpus_per_vm=4)
    # The VM's python is found on its PATH (as `python3` on a real VM), so that a job's
    # own PATH decides whether its training finds it.
    shutil.copy(write_fake_python(tmp_path), fleet[0].bin_dir / "vm-python")
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python="vm-python")
    vm_id = ids["vm0"]
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    # Every job is queued before the daemons start (none is claimed before its row is set).
    fine = ("--fake_seconds", "1")
    d = await new_job(db, 1, fine, env=(("d", "/tmp/elsewhere"),), max_retries=0)
    sig = await new_job(db, 1, fine, max_retries=0)
    wd = await new_job(db, 1, fine, max_retries=0)
    hand_written = {sig: {"rlfleet_sig": "TERM"}, wd: {"rlfleet_wd": str(stranger.pid)}}
    async with db.transaction() as session:
        for job_id, env in hand_written.items():
            await session.execute(update(Job).where(Job.id == job_id).values(env=env))
    path = await new_job(db, 1, fine, env=(("PATH", "/nonexistent"),), max_retries=1)
    exit127 = await new_job(db, 1, ("--fake_exit", "127"), max_retries=1)
    try:
        async with daemons(db, nats.url, CONFIG):
            await wait_vm_healthy(db, vm_id)
            with VMWatch(db, vm_id) as watch:
                ok = [await wait_status(db, d, "completed", 60)]
                for job_id in (sig, wd):
                    job = await wait_status(db, job_id, {"completed", "failed"}, 60)
                    if job.status == "completed":
                        ok.append(job)
                    else:  # refused as a row: once, saying why, before any VM saw it
                        assert job.failure_reason == "config_error", job.status_reason
                        why = await reasons(db, job_id)
                        assert any("is set by the scheduler" in r for r in why), why
                        assert job.attempt == 0 and job.vm_id is None
                bad = []
                for job_id in (path, exit127):  # failed, retried once, then given up
                    deadline = time.monotonic() + 60
                    while (job := await job_row(db, job_id)).retry_decision != "give_up":
                        assert time.monotonic() < deadline, (job.id, job.status_reason)
                        await asyncio.sleep(0.1)
                    bad.append(job)
            assert watch.bad == [], watch.bad[:5]
    finally:
        stranger.kill()
        stranger.wait()
    assert stranger.returncode == -9, "the job's rlfleet_wd got the stranger signalled"
    for job in ok:
        assert (job.attempt, job.retry_count, job.exit_code) == (1, 0, 0), job.status_reason
    for job in bad:
        assert (job.failure_reason, job.exit_code) == ("exit_nonzero", 127), job.status_reason
        assert (job.attempt, job.retry_count, job.machine_faults) == (2, 1, 0)
        assert not any(r.startswith("launch_failed") for r in await reasons(db, job.id))


async def test_an_exit_code_forged_by_a_neighbour_is_not_taken_while_the_job_runs(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a running job into whose exit_code another job of the same VM account wrote
    0, the job is not recorded completed while its process runs: it completes once its
    wrapper really ended, with its own exit code (3), and its GPU was held until then."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    async with daemons(db, nats.url, CONFIG):
        await wait_vm_healthy(db, ids["vm0"])
        victim = await new_job(db, 1, ("--fake_seconds", "4", "--fake_exit", "3"), max_retries=0)
        running = await wait_status(db, victim, "running", 30)
        d = await job_attempt_dir(db, victim, fleet[0].home)
        (d / "exit_code").write_text("0\n")
        while (job := await job_row(db, victim)).status == "running":
            await asyncio.sleep(0.05)
        assert not alive(running.remote_pid), f"recorded {job.status} while its process ran"
    assert (job.status, job.exit_code, job.failure_reason) == ("failed", 3, "exit_nonzero")


async def test_a_setsid_child_of_a_job_dies_when_the_job_is_cancelled(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a running job that started a process in a session of its own (out of its
    attempt's process group), cancelling the job stops that process too."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    async with daemons(db, nats.url, CONFIG) as transport:
        await wait_vm_healthy(db, ids["vm0"])
        job_id = await new_job(db, 1, ("--fake_seconds", "60", "--fake_setsid_child"))
        running = await wait_status(db, job_id, "running", 30)
        inst = await installation(db)
        pid_file = fleet[0].home / default_output_dir(inst, job_id)[2:] / "setsid_child.pid"
        child = int(await wait_file(pid_file, timeout=30))
        assert alive(child) and alive(running.remote_pid)
        result = await cancel_job(db, transport, job_id, grace_s=2)
        assert result.dead, result
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the setsid child survived the cancel"
        await asyncio.sleep(0.05)


# --- against OpenSSH's sshd -------------------------------------------------------------------


async def test_hostile_files_behind_real_sshd_cost_the_poll_nothing(
    sshd: RealSshd,  # noqa: F811 - the fixture
    db: Database,
) -> None:
    """Behind OpenSSH's sshd, a job writing hostile files (as above) beside another job:
    every sweep reaches the VM and finds it healthy, and both complete on their first
    attempt with exit code 0."""
    target = sshd.target
    async with db.transaction() as session:
        vm = await add_vm(
            session,
            VMSpec(
                name="real",
                host=target.host,
                port=target.port,
                user=target.user,
                ssh_key_path=target.ssh_key_path,
                known_hosts=target.known_hosts,
            ),
        )
        target = VMTarget.from_vm(vm)
    transport = SSHTransport()
    poller = GpuPoller(db, transport)
    try:
        assert (await poller.sweep()).reachable == 1
        jobs = [
            await launch_on(db, transport, target, 0, "--fake_hostile", "--fake_seconds", "4"),
            await launch_on(db, transport, target, 1, "--fake_seconds", "5"),
        ]
        deadline = time.monotonic() + 60
        statuses: list[Any] = []
        while statuses != ["completed", "completed"]:
            assert time.monotonic() < deadline, statuses
            stats = await poller.sweep()
            async with db.transaction() as session:
                row = await session.get(VM, target.id, populate_existing=True)
                assert row is not None
                assert (stats.reachable, row.status, row.last_error) == (1, "healthy", None)
            statuses = [(await job_row(db, j)).status for j in jobs]
            await asyncio.sleep(0.1)
    finally:
        await transport.close()
    for job_id in jobs:
        job = await job_row(db, job_id)
        assert (job.attempt, job.retry_count, job.exit_code) == (1, 0, 0)


# --- rows no claim or launch wrote ------------------------------------------------------------


async def hand_written(db: Database, vm_id: int, gpu: int, status: JobStatus, **values: Any) -> int:
    """A job row moved to `status` on `vm_id` holding GPU `gpu`, as a hand or a bug writes
    one: no launch token, no lease, unless `values` say otherwise."""
    async with db.transaction() as session:
        job = await insert_job(
            session,
            JobSpec("m", "d", ("format",), extra_args=("--fake_seconds", "0.5"), max_retries=0),
            actor="test",
        )
        await session.execute(
            update(Job)
            .where(Job.id == job.id)
            .values(
                **{
                    "status": status.value,
                    "vm_id": vm_id,
                    "attempt": 1,
                    "gpu_indices": [gpu],
                    "launch_token": None,
                    "lease_expires_at": None,
                    **values,
                }
            )
        )
        await session.execute(
            update(GPU).where(GPU.vm_id == vm_id, GPU.index == gpu).values(job_id=job.id)
        )
        return job.id


async def test_hand_written_live_rows_without_token_or_lease_are_resolved_once(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a `running` row with no launch token (the poller cannot find its attempt), a
    `running` row whose launch left no pid, and a `starting` row with no lease (no expiry
    would ever take it back): the running ones fail once as `vanished` saying why (no
    retry allowed: they stay failed), the starting one goes back to the queue and runs to
    completion, and the GPUs are free again."""
    fleet = await sim_fleet(1, gpus_per_vm=3)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    vm_id = ids["vm0"]
    async with daemons(db, nats.url, CONFIG):
        await wait_vm_healthy(db, vm_id)
        no_token = await hand_written(db, vm_id, 0, JobStatus.RUNNING, remote_pid=4242)
        no_pid = await hand_written(db, vm_id, 1, JobStatus.RUNNING, launch_token=new_token())
        no_lease = await hand_written(db, vm_id, 2, JobStatus.STARTING)
        failed = [await wait_status(db, j, "failed", 30) for j in (no_token, no_pid)]
        done = await wait_status(db, no_lease, "completed", 60)
        async with db.transaction() as session:
            held = await session.scalar(
                select(GPU.job_id).where(GPU.vm_id == vm_id, GPU.job_id.is_not(None)).limit(1)
            )
    for job, says in zip(failed, ("without a launch token", "without a pid"), strict=True):
        assert job.failure_reason == "vanished", job.status_reason
        events = await reasons(db, job.id)
        assert sum(says in r for r in events) == 1, events
    assert "lease expired" in " ".join(await reasons(db, no_lease))
    assert (done.exit_code, done.attempt) == (0, 2) and held is None  # claimed anew
