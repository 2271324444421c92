"""A cgroup v2 directory for the tests that need one (`scheduler.remote.cgroup`): made under
the machine's cgroup2 mount for one test, and emptied (`cgroup.kill`) and removed after it.

Where the machine has no writable cgroup v2 with `cgroup.kill` (not Linux, no cgroup2
mounted, not allowed to make one), these tests are skipped on a developer's machine but
fail under CI=true, like `tests.requires`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.requires import in_ci


def cgroup2_mount() -> Path | None:
    """The machine's (first) cgroup2 mount point, None without one."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None


def require_cgroup() -> Path:
    """The cgroup2 mount, when this process can make cgroups with `cgroup.kill` under it;
    otherwise skip the calling test (fail it under CI)."""
    mount = cgroup2_mount()
    problem = "no cgroup2 file system is mounted"
    if mount is not None:
        probe = mount / f"rlfleet-test-probe-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
        except OSError as exc:
            problem = f"cannot make a cgroup under {mount}: {exc}"
        else:
            has_kill = (probe / "cgroup.kill").exists()
            probe.rmdir()
            if has_kill:
                return mount
            problem = f"the cgroups under {mount} have no cgroup.kill (Linux < 5.14)"
    if in_ci():
        pytest.fail(f"{problem}; under CI=true its tests fail instead of skipping", pytrace=False)
    pytest.skip(problem)


def remove_cgroup(path: Path) -> None:
    """Kill every process in the cgroup `path` and below, then remove it and them."""
    if not path.is_dir():
        return
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 10
    while "populated 1" in _read(path / "cgroup.events") and time.monotonic() < deadline:
        time.sleep(0.05)
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@contextlib.contextmanager
def cgroup_root() -> Iterator[Path]:
    """A fresh cgroup for the test's attempts to be made under (`RLFLEET_CGROUP_ROOT`),
    removed with everything in it afterwards."""
    mount = require_cgroup()
    root = mount / f"rlfleet-test-{secrets.token_hex(6)}"
    root.mkdir()
    try:
        yield root
    finally:
        remove_cgroup(root)


def kill_pid(pid: int) -> None:
    """SIGKILL `pid` if it still runs (a process a test let escape); 0 or less: none (never
    a process group)."""
    if pid <= 1:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def attempt_cgroups(root: Path) -> list[Path]:
    """The attempt cgroups under `root`."""
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("rlfleet-"))
