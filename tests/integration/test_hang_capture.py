"""Issue 29, "High": a stalled job that plants its diagnostics paths (links to /dev/zero,
FIFOs) in its attempt directory costs the poller neither its memory nor a hang. The
capture writes only a file it made itself (mktemp), never reads a path the job could have
placed, and the job is stopped at its startup timeout with its diagnostics kept; on the
in-process fleet and behind OpenSSH's sshd, with the poller, dispatcher and requeue
manager of tests/workloads/support.py `daemons` in this process."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.requeue import RequeueConfig
from scheduler.retry import RetryPolicy
from tests.backdate import age_progress
from tests.integration.test_hang import diagnostics, failed_events
from tests.sshd import SshdFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    attempt_dirs,
    daemons,
    installation,
    new_job,
    wait_status,
)

pytestmark = pytest.mark.slow

CONFIG = RequeueConfig(
    interval_s=0.2, recheck_after_s=0.3, policy=RetryPolicy(base_delay_s=0.1, jitter=0.0)
)
GROWTH_LIMIT = 128 * 1024 * 1024
"""Most this process's peak memory (the poller's, among others) may grow by while the
stalled job is captured and stopped."""
PLANTED = ("diagnostics.txt", "diagnostics.txt.tmp")
"""The paths the capture once wrote through and read back whole."""


def plant(directory: Path, how: str) -> None:
    """What a job can do to its own attempt directory before it stalls."""
    for name in PLANTED:
        path = directory / name
        if how == "zero":
            path.symlink_to("/dev/zero")
        else:
            os.mkfifo(path)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


async def wait_dir(home: Path, db: Database, job_id: int) -> Path:
    deadline = time.monotonic() + 30
    while not (found := attempt_dirs(home, await installation(db), job_id, 1)):
        assert time.monotonic() < deadline, "no attempt directory"
        await asyncio.sleep(0.05)
    (directory,) = found
    return directory


async def planted_job_is_captured_and_stopped(
    db: Database, nats_url: str, home: Path, how: str
) -> None:
    """A job whose trainer never reports progress (30 s startup timeout, no retry) plants
    `how` at the capture's old paths; its launch is aged past the timeout: checked, it
    fails `startup_timeout` within 30 s, its diagnostics kept (in the database and as a
    regular file in its attempt directory), the process's peak memory bounded."""
    async with daemons(db, nats_url, CONFIG):
        job_id = await new_job(db, 1, ("--fake_hang_at", "0"), startup_timeout_s=30, max_retries=0)
        await wait_status(db, job_id, "running")
        directory = await wait_dir(home, db, job_id)
        plant(directory, how)
        Path("/proc/self/clear_refs").write_text("5")
        before = _kib("VmRSS")
        await age_progress(db, job_id, 31)
        job = await wait_status(db, job_id, "failed", timeout=30)
        growth = (_kib("VmHWM") - before) * 1024
    assert job.failure_reason == "startup_timeout", job.status_reason
    assert "no progress reported" in ((await failed_events(db, job_id))[0].reason or "")
    (diag,) = await diagnostics(db, job_id)
    assert "waiting for a peer" in diag.content, diag.content[-2000:]
    assert growth < GROWTH_LIMIT, f"peak memory grew by {growth / 2**20:.0f} MiB"
    kept = directory / "diagnostics.txt"
    assert stat.S_ISREG(kept.lstat().st_mode), "the capture's file is not a regular file"
    assert "waiting for a peer" in kept.read_text()
    # Nothing of the capture's own is left behind beside it.
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".diagnostics")]
    print(f"{how}: peak memory grew by {growth / 2**20:.1f} MiB during the capture")


@pytest.mark.parametrize("how", ["zero", "fifo"])
async def test_planted_diagnostics_paths_cost_the_poller_nothing(
    sim_fleet: Any, db: Database, nats: EmbeddedNats, how: str
) -> None:
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    await planted_job_is_captured_and_stopped(db, nats.url, fleet[0].home, how)


@pytest.mark.parametrize("how", ["zero", "fifo"])
async def test_planted_diagnostics_paths_behind_openssh(
    tmp_path: Path, db: Database, nats: EmbeddedNats, how: str
) -> None:
    fleet = SshdFleet(tmp_path / "sshd-fleet")
    try:
        fleet.add_vm("vm0", gpus=1)
        await fleet.register(db, entrypoint=str(FAKE_TRAIN))
        await planted_job_is_captured_and_stopped(db, nats.url, fleet[0].home, how)
    finally:
        fleet.close()
