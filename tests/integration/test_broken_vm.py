"""A VM that cannot run training (its python or entrypoint is missing or not executable)
is the VM's fault, not the job's: with the real fleet, poller, dispatcher, requeue
manager, NATS and Postgres, the attempt fails as `launch_failed`, the VM is kept out of
use with the reason until its python works again, and the job runs elsewhere without
using up a retry."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import select, update

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.models import VM, JobEvent
from scheduler.requeue import RequeueConfig
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    RLFLEET,
    daemons,
    new_job,
    wait_status,
    write_fake_python,
)

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, recheck_after_s=0.3)


async def vm_row(db: Database, name: str) -> VM:
    """The VM as the database has it now."""
    async with db.transaction() as session:
        vm = await session.scalar(select(VM).where(VM.name == name))
        assert vm is not None
        return vm


async def wait_vm(db: Database, name: str, status: str, timeout: float = 30) -> VM:
    """Wait until the VM is `status`."""
    deadline = time.monotonic() + timeout
    while (vm := await vm_row(db, name)).status != status:
        assert time.monotonic() < deadline, f"VM {name} is {vm.status} ({vm.last_error})"
        await asyncio.sleep(0.1)
    return vm


async def wait_failed_event(db: Database, job_id: int, timeout: float = 60) -> str:
    """The reason of the job's first move to `failed`, once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        async with db.transaction() as session:
            reason = await session.scalar(
                select(JobEvent.reason)
                .where(JobEvent.job_id == job_id, JobEvent.to_status == "failed")
                .order_by(JobEvent.id)
            )
        if reason is not None:
            return reason
        assert time.monotonic() < deadline, f"job {job_id} never failed"
        await asyncio.sleep(0.05)


def vm_show(db: Database, name: str) -> dict[str, object]:
    """`rlfleet vm show NAME --json`, run as a user would."""
    env = dict(os.environ, RLFLEET_DATABASE_URL=db.url)
    out = subprocess.run(
        [str(RLFLEET), "vm", "show", name, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    data = json.loads(out.stdout)
    assert isinstance(data, dict)
    return data


async def test_a_vm_whose_python_cannot_run_is_marked_and_the_job_runs_elsewhere(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given two VMs, the first with a python that is not executable (the second drained
    at first, so the job lands on the first), when a job with no retries allowed is run,
    then its attempt fails as launch_failed with the shell's reason, the VM turns
    unhealthy and says why in `vm show`, the job runs to completion on the other VM with
    retry_count still 0; and once the python is fixed, the VM is healthy again."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    good_python = write_fake_python(tmp_path)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=good_python)
    broken = tmp_path / "broken-python"
    shutil.copy(good_python, broken)
    broken.chmod(0o644)  # the shell refuses to run it: exit 126
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.name == "vm0").values(python=str(broken)))
        await session.execute(update(VM).where(VM.name == "vm1").values(draining=True))

    async with daemons(db, nats.url, CONFIG):
        await wait_vm(db, "vm0", "healthy")
        job_id = await new_job(db, 1, ("--fake_seconds", "0.5"), max_retries=0)

        # The failure is brief: the job is retried at once (and waits: vm1 is drained).
        reason = await wait_failed_event(db, job_id)
        assert reason.startswith("launch_failed: exit 126: "), reason
        assert "Permission denied" in reason, reason
        async with db.transaction() as session:
            attempt1 = await session.scalar(
                select(JobEvent.attempt).where(
                    JobEvent.job_id == job_id, JobEvent.to_status == "failed"
                )
            )
        assert attempt1 == 1
        vm0 = await wait_vm(db, "vm0", "unhealthy")
        assert vm0.launch_error is not None and "Permission denied" in vm0.launch_error
        shown = vm_show(db, "vm0")
        assert shown["status"] == "unhealthy"
        assert "Permission denied" in str(shown["launch_error"])
        assert "Permission denied" in str(shown["last_error"])

        async with db.transaction() as session:
            await session.execute(update(VM).where(VM.name == "vm1").values(draining=False))
        done = await wait_status(db, job_id, "completed", timeout=60)
        assert done.vm_id == ids["vm1"] and done.attempt == 2 and done.exit_code == 0
        assert (done.retry_count, done.max_retries) == (0, 0)
        assert (await vm_row(db, "vm0")).status == "unhealthy", "still broken: no jobs"
        deadline = time.monotonic() + 30
        while "(check: exit 126: " not in ((vm0 := await vm_row(db, "vm0")).last_error or ""):
            assert time.monotonic() < deadline, f"no check of vm0's python: {vm0.last_error}"
            await asyncio.sleep(0.1)
        assert vm0.status == "unhealthy" and "Permission denied" in vm0.last_error

        broken.chmod(0o755)
        vm0 = await wait_vm(db, "vm0", "healthy")
        assert vm0.launch_error is None and vm0.last_error is None

    async with db.transaction() as session:
        reasons = (
            await session.scalars(
                select(JobEvent.reason).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            )
        ).all()
    assert any(r and r.startswith("launch_failed: exit 126: ") for r in reasons), reasons
    assert any(r and "does not count against max_retries" in r for r in reasons), reasons
