"""A cgroup per attempt (`scheduler.remote.cgroup`), the VM-side scripts run in a real /bin/sh
with a temp $HOME and a real cgroup v2 directory: a process that double-forks, calls setsid
and clears its environment stops with its attempt (kill, fence, the end of the training);
the marker is the fallback, as documented; the job's `cgroup` file is checked before use;
the probe says which a VM gives."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.remote.cgroup import CGROUP_FILE, STALE_MINUTES, parse_tracking, probe_lines
from scheduler.remote.kill import kill_script, parse_kill
from scheduler.remote.launch import launch_script, parse_launch
from scheduler.remote.layout import default_output_dir
from tests.cgroups import attempt_cgroups, cgroup_root, kill_pid
from tests.unit.test_remote import home, run, sh, spec  # noqa: F401 - the fixture
from tests.workloads.support import alive, wait_file

pytestmark = pytest.mark.slow  # each starts a real attempt: a second or more


@pytest.fixture
def cg_root(home: Path) -> Iterator[Path]:  # noqa: F811 - the fixture
    """A fresh cgroup named in the VM's `~/.rlfleet/env` as `RLFLEET_CGROUP_ROOT`."""
    with cgroup_root() as root:
        vm_env(home, f'RLFLEET_CGROUP_ROOT="{root}"')
        yield root


def vm_env(vm_home: Path, line: str) -> None:
    """Write the VM's `~/.rlfleet/env` as deploy/bootstrap-vm.sh does."""
    path = vm_home / ".rlfleet" / "env"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"HF_HOME=/tmp/hf\n{line}\n")


async def start_escaping(home: Path, job_id: int, *extra: str, **over: object) -> tuple[int, int]:  # noqa: F811
    """Launch an attempt whose training starts a process that double-forks, calls setsid
    and clears its environment; (the wrapper's pid, the escaped process's pid)."""
    over.setdefault("output_dir", default_output_dir(run(job_id, 1).installation, job_id))
    launch = spec(run=run(job_id, 1), extra_args=["--fake_escape_child", *extra], **over)
    code, out, err = await sh(launch_script(launch))
    assert code == 0, err
    result = parse_launch(out)
    assert result is not None
    out_dir = home / ".rlfleet" / run(job_id, 1).installation / "outputs" / str(job_id)
    escaped = int(await wait_file(out_dir / "escape_child.pid", timeout=20))
    assert alive(escaped)
    return result.pid, escaped


async def gone(pid: int, timeout: float = 10) -> bool:
    """Whether `pid` ends within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_an_escaped_process_dies_with_the_kill_and_its_cgroup_goes(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
) -> None:
    """Given an attempt in a cgroup whose training ignores TERM and left a process that
    double-forked, called setsid and cleared its environment, when the attempt is killed
    (cancel, hang stop, leftover sweep: the one kill script), then that process is gone
    and so is the attempt's cgroup."""
    args = ("--fake_seconds", "60", "--fake_ignore_term")
    wrapper, escaped = await start_escaping(home, 21, *args)
    try:
        (cgroup,) = attempt_cgroups(cg_root)
        d = home / run(21, 1).relative
        assert (d / CGROUP_FILE).read_text().strip() == str(cgroup)
        assert f"tracked by cgroup {cgroup}" in (d / "train.log").read_text()
        code, out, _ = await sh(kill_script(run(21, 1), grace_s=1))
        assert code == 0 and parse_kill(out) == "killed", out
        assert await gone(escaped, 5), "the escaped process outlived the kill"
        assert not alive(wrapper)
        assert attempt_cgroups(cg_root) == []
        assert parse_kill((await sh(kill_script(run(21, 1))))[1]) == "gone"
    finally:
        kill_pid(escaped)


async def test_what_a_crashed_wrapper_left_dies_with_the_next_kill(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
) -> None:
    """Given an attempt in a cgroup whose wrapper and training were killed outright (a
    crash: nobody cleaned up), when the attempt is killed (the leftover sweep), then the
    escaped process is gone and so is the cgroup."""
    wrapper, escaped = await start_escaping(home, 26, "--fake_seconds", "60")
    try:
        os.killpg(wrapper, signal.SIGKILL)
        assert await gone(wrapper, 5) and alive(escaped)
        code, out, _ = await sh(kill_script(run(26, 1), grace_s=2))
        assert code == 0 and parse_kill(out) in ("terminated", "killed"), out
        assert await gone(escaped, 5), "the escaped process outlived the kill"
        assert attempt_cgroups(cg_root) == []
    finally:
        kill_pid(escaped)


async def test_what_an_attempt_leaves_behind_dies_when_its_training_ends(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
) -> None:
    """Given an attempt in a cgroup whose training left an escaped process and exited 0,
    then that process is gone once the exit code is written, and so is the cgroup."""
    # The training outlives the escaped process's start by a moment, so that the check
    # that it started (`start_escaping`) cannot race the end this test is about.
    _wrapper, escaped = await start_escaping(home, 22, "--fake_seconds", "3")
    try:
        d = home / run(22, 1).relative
        assert (await wait_file(d / "exit_code", timeout=20)).strip() == "0"
        assert await gone(escaped, 2), "the escaped process outlived its attempt"
        assert attempt_cgroups(cg_root) == []
    finally:
        kill_pid(escaped)


async def test_an_escaped_process_dies_with_a_fence(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
) -> None:
    """Given an attempt in a cgroup whose training ignores TERM and whose lease is never
    renewed, when its watchdog fences it (TERM, then KILL), then the escaped process is
    gone too, and so is the cgroup."""
    args = ("--fake_seconds", "60", "--fake_ignore_term")
    _wrapper, escaped = await start_escaping(home, 23, *args, fence_after_s=2, fence_grace_s=1)
    try:
        d = home / run(23, 1).relative
        await wait_file(d / "fenced_reason", timeout=20)
        assert await gone(escaped, 10), "the escaped process outlived the fence"
        assert (await wait_file(d / "exit_code", timeout=10)).strip() == "137"
        deadline = time.monotonic() + 5
        while attempt_cgroups(cg_root) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert attempt_cgroups(cg_root) == []
    finally:
        kill_pid(escaped)


async def test_with_the_marker_an_escaped_process_outlives_the_kill_as_documented(
    home: Path,  # noqa: F811 - the fixture
) -> None:
    """Given a VM whose `~/.rlfleet/env` turns cgroups off (`RLFLEET_CGROUP_ROOT=none`),
    the attempt says it is tracked by the marker, and a process that cleared its
    environment and left the process group is not found by a kill (docs/security.md)."""
    vm_env(home, "RLFLEET_CGROUP_ROOT=none")
    _wrapper, escaped = await start_escaping(home, 24, "--fake_seconds", "60")
    try:
        d = home / run(24, 1).relative
        assert not (d / CGROUP_FILE).exists()
        log = (d / "train.log").read_text()
        assert "tracked by the environment marker (RLFLEET_CGROUP_ROOT=none)" in log
        code, out, _ = await sh(kill_script(run(24, 1), grace_s=2))
        assert parse_kill(out) in ("terminated", "killed"), out
        await asyncio.sleep(0.3)
        assert alive(escaped), "documented: the marker cannot find it (else update the docs)"
    finally:
        kill_pid(escaped)


async def test_a_cgroup_file_written_by_the_job_kills_nothing_else(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
) -> None:
    """Given a job that rewrote its `cgroup` file to name another cgroup (one with a
    process of someone else in it, a path with `..`, a non-cgroup directory), when its
    attempt is killed, then that other process lives on."""
    victim_cg = cg_root / "victim"
    victim_cg.mkdir()
    victim = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        (victim_cg / "cgroup.procs").write_text(str(victim.pid))
        d = home / run(25, 1).relative
        wrapper, escaped = await start_escaping(home, 25, "--fake_seconds", "60")
        (cgroup,) = attempt_cgroups(cg_root)
        for forged in (
            str(victim_cg),
            f"{cgroup}/../victim",
            f"{victim_cg}/x/../../{cgroup.name}",
            str(home),
        ):
            (d / CGROUP_FILE).write_text(forged + "\n")
            code, out, _ = await sh(kill_script(run(25, 1), grace_s=1))
            assert alive(victim.pid), forged
        assert not alive(wrapper)
        kill_pid(escaped)
    finally:
        victim.kill()
        await victim.wait()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (None, "cgroup v2 ({root}, cgroup.kill)"),
        ("RLFLEET_CGROUP_ROOT=none", "marker (RLFLEET_CGROUP_ROOT=none)"),
        (
            "export RLFLEET_CGROUP_ROOT='{home}'",
            "marker (RLFLEET_CGROUP_ROOT is not a writable cgroup v2 directory)",
        ),
        (
            "RLFLEET_CGROUP_ROOT={root}/../x",
            "marker (RLFLEET_CGROUP_ROOT is not a writable cgroup v2 directory)",
        ),
    ],
)
async def test_the_probe_says_how_a_vm_tracks_an_attempts_processes(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
    line: str | None,
    expected: str,
) -> None:
    """The poll's probe tries a cgroup for real and says what a launch would get; a root
    that is not a writable cgroup v2 directory falls back to the marker, saying why."""
    if line is not None:
        vm_env(home, line.format(root=cg_root, home=home))
    code, out, err = await sh("\n".join(probe_lines()))
    assert code == 0, err
    assert parse_tracking(out.splitlines()) == expected.format(root=cg_root)
    assert attempt_cgroups(cg_root) == [] and not list(cg_root.glob("rlfleet-probe-*"))


def test_a_tracking_line_is_read_without_trusting_it() -> None:
    """What the VM's shell printed is checked: a path with odd characters or `..`, an
    unknown way, or no line at all gives None; a marker's reason is made printable."""
    mark = "rlfleet-tracking"
    assert parse_tracking([f"{mark} cgroup2 kill /sys/fs/cgroup/a b"]) is None
    assert parse_tracking([f"{mark} cgroup2 kill /sys/fs/cgroup/../x"]) is None
    assert parse_tracking([f"{mark} cgroup2 magic /sys/fs/cgroup/x"]) is None
    assert parse_tracking(["garbage"]) is None
    assert parse_tracking([f"{mark} marker why\x1b[2J"]) == "marker (why[2J)"
    assert parse_tracking([f"{mark} cgroup2 freeze /sys/fs/cgroup/x"]) == (
        "cgroup v2 (/sys/fs/cgroup/x, freeze)"
    )


# --- deploy/bootstrap-vm.sh --cgroup-root ------------------------------------------------------

BOOTSTRAP = Path(__file__).parents[2] / "deploy" / "bootstrap-vm.sh"


def bootstrap(vm_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The bootstrap script run locally as the VM's account, installing nothing."""
    key = vm_home / "host_key.pub"
    key.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample test\n")
    base = ["--venv", str(vm_home / "venv"), "--no-install", "--allow-no-gpu"]
    base += ["--host-key", str(key), "--hostname", "vm"]
    env = {"HOME": str(vm_home), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    return subprocess.run(
        ["bash", str(BOOTSTRAP), *base, *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_bootstrap_names_the_cgroup_root_in_the_vm_env(tmp_path: Path) -> None:
    """`--cgroup-root DIR` writes `RLFLEET_CGROUP_ROOT=DIR` to `~/.rlfleet/env` (once, a
    second run replaces it), warning when DIR is no cgroup the account may write; a path
    that is not plain is refused (exit 2) before anything is done."""
    first = bootstrap(tmp_path, "--cgroup-root", "/sys/fs/cgroup/nowhere")
    assert first.returncode == 0, first.stderr
    assert "is not a cgroup v2 directory this account may write" in first.stderr
    again = bootstrap(tmp_path, "--cgroup-root", "none")
    assert again.returncode == 0, again.stderr
    lines = (tmp_path / ".rlfleet" / "env").read_text().splitlines()
    assert [line for line in lines if "RLFLEET_CGROUP_ROOT=" in line] == [
        "RLFLEET_CGROUP_ROOT=none"
    ]
    assert "HF_TOKEN" in "\n".join(lines)
    bad = bootstrap(tmp_path, "--cgroup-root", "/sys/fs/cgroup/a/../b")
    assert bad.returncode == 2 and "--cgroup-root must be" in bad.stderr


async def test_the_probe_removes_the_empty_cgroups_a_crash_left_and_nothing_else(
    home: Path,  # noqa: F811 - the fixture
    cg_root: Path,
) -> None:
    """Given, under the root, an empty attempt cgroup and a probe's, both older than
    STALE_MINUTES (a wrapper killed outright, a poll cut short), a fresh empty one (a
    launch between making its cgroup and moving in), an old one with a process in it and
    an old one not of rlfleet's naming, a poll's probe removes the first two only."""
    old = time.time() - (STALE_MINUTES + 1) * 60
    dirs = {
        name: cg_root / name
        for name in ("rlfleet-3-1-00000000000000aa-77", "rlfleet-probe-12", "rlfleet-4-1-bb-9")
    }
    dirs["busy"] = cg_root / "rlfleet-5-1-00000000000000cc-78"
    dirs["other"] = cg_root / "someone-else"
    for path in dirs.values():
        path.mkdir()
    sleeper = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        (dirs["busy"] / "cgroup.procs").write_text(str(sleeper.pid))
        for key in ("rlfleet-3-1-00000000000000aa-77", "rlfleet-probe-12", "busy", "other"):
            os.utime(dirs[key], (old, old))
        code, out, err = await sh("\n".join(probe_lines()))
        assert code == 0, err
        left = sorted(p.name for p in cg_root.iterdir() if p.is_dir())
        assert left == sorted(["rlfleet-4-1-bb-9", dirs["busy"].name, "someone-else"])
        assert alive(sleeper.pid)
    finally:
        sleeper.kill()
        await sleeper.wait()
