"""The VM tree an installation writes (`~/.rlfleet`: attempt directories, logs, launch
scripts, output directories, workdirs) is its account's alone (issue 29, point 8): created
with umask 077, `~/.rlfleet` tightened to 0700 when an older rlfleet left it open, and
another Unix user on the VM reads none of it."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.workdir import pack
from tests.fleet import SimFleet
from tests.integration.test_retry_caps import CONFIG
from tests.workloads.support import (
    FAKE_TRAIN,
    daemons,
    installation,
    job_attempt_dir,
    new_job,
    wait_status,
)

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@contextmanager
def traversable(path: Path) -> Iterator[None]:
    """The directories above `path` (up to /tmp) made traversable by others for the block
    (pytest's own are 0700), so that only the modes rlfleet sets can keep a stranger out."""
    changed = []
    for parent in [path, *path.parents]:
        if parent in (Path("/"), Path("/tmp")):
            break
        old = mode(parent)
        if not old & 0o001:
            changed.append((parent, old))
            os.chmod(parent, old | 0o001)
    try:
        yield
    finally:
        for parent, old in reversed(changed):
            os.chmod(parent, old)


def stranger_reads(path: Path) -> bool:
    """Whether user `nobody` can read `path` (a file) or list it (a directory)."""
    what = ["ls", str(path)] if path.is_dir() else ["cat", str(path)]
    done = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *what],
        capture_output=True,
        timeout=30,
    )
    return done.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
async def test_the_vm_tree_is_private_to_its_account(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given a VM whose `~/.rlfleet` an older rlfleet left 0755, and a job with a workdir:
    after the job ran, `~/.rlfleet`, the attempt directory, the output directory and the
    workdir cache are 0700, the attempt's files (log, launch script, pid, exit code) and the
    outputs 0600 or tighter, and user `nobody` reads and lists none of them."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    home = fleet[0].home
    (home / ".rlfleet").mkdir(mode=0o755, exist_ok=True)
    os.chmod(home / ".rlfleet", 0o755)
    source = tmp_path / "project"
    source.mkdir()
    (source / "notes.txt").write_text("the job's code\n")
    job_id = await new_job(db, 1, ("--fake_seconds", "0.5"), workdir=pack(source), max_retries=0)
    async with daemons(db, nats.url, CONFIG):
        job = await wait_status(db, job_id, {"completed", "failed"}, 90)
    assert job.status == "completed", job.status_reason
    attempt = await job_attempt_dir(db, job_id, home)
    inst = await installation(db)
    root = home / ".rlfleet"
    outputs = root / inst / "outputs" / str(job_id)
    workdirs = root / inst / "workdirs"
    for directory in (root, attempt, outputs, workdirs):
        assert directory.is_dir(), directory
        assert mode(directory) & 0o077 == 0, (directory, oct(mode(directory)))
    files = [attempt / name for name in ("train.log", "launch.sh", "pid", "exit_code")]
    files += [p for p in outputs.rglob("*") if p.is_file()]
    for path in files:
        assert mode(path) & 0o077 == 0, (path, oct(mode(path)))
    with traversable(home):
        for path in (root, attempt, outputs, workdirs, *files):
            assert not stranger_reads(path), path
        assert stranger_reads(home), "the test cannot tell: nobody cannot list the home"
