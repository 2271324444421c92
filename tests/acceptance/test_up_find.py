"""A shell that never sourced STATE_DIR/env finds the `rlfleet up` that runs (issue 33,
point 1); a stale state of a dead `up` is not used, an env file others can write is refused."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.test_up import Up
from tests.workloads.support import RLFLEET

WAY_OUT = "is `rlfleet up` running? start it, or set RLFLEET_DATABASE_URL / source STATE_DIR/env"


@pytest.fixture
def short() -> Iterator[Path]:
    """A directory with a short path for HOME and the state dir: PostgreSQL's socket lives
    in the state dir and its path must stay under 108 bytes, which a test's own tmp_path
    under parallel workers (`…/popen-gwN/test_…0/home/.local/share/rlfleet/postgres/…`)
    does not."""
    path = Path(tempfile.mkdtemp(prefix="rlf-up-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Up]]:
    """Each `up` a test starts, killed with its servers afterwards."""
    ups: list[Up] = []
    yield ups
    for up in ups:
        try:
            pids = json.loads((up.state_dir / "up.json").read_text()).get("server_pids") or {}
        except (OSError, ValueError):
            pids = {}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)
        for pid in pids.values():
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def bare_cli(
    home: Path, *args: str, state_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`rlfleet ARGS` in a shell that sourced nothing: no database, NATS or state dir set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env.pop("XDG_DATA_HOME", None)
    env["HOME"] = str(home)
    if state_dir is not None:
        env["RLFLEET_STATE_DIR"] = str(state_dir)
    return subprocess.run(
        [str(RLFLEET), *args], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
def test_a_shell_without_the_env_finds_the_running_up_and_refuses_an_env_file_others_can_write(
    tmp_path: Path, short: Path, started: list[Up]
) -> None:
    # Given `up` running on the default state dir of HOME
    home = short / "home"
    state_dir = home / ".local" / "share" / "rlfleet"
    state_dir.mkdir(parents=True)
    up = Up(state_dir, home)
    started.append(up)
    up.wait_ready()
    # When a shell that sourced nothing lists the jobs, it finds that `up`
    listed = bare_cli(home, "job", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    # and so does one of another HOME, through RLFLEET_STATE_DIR
    other = tmp_path / "other"
    other.mkdir()
    named = bare_cli(other, "job", "list", "--json", state_dir=state_dir)
    assert named.returncode == 0, named.stderr
    # No secret is printed
    token = (state_dir / "nats.token").read_text().strip()
    password = (state_dir / "postgres.password").read_text().strip()
    for out in (listed, named):
        assert token not in out.stdout + out.stderr
        assert password not in out.stdout + out.stderr
    # When the env file is writable by others, it is refused in one line (exit 2)
    (state_dir / "env").chmod(0o622)
    refused = bare_cli(home, "job", "list", "--json")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "writable by others" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert token not in refused.stderr


@pytest.mark.slow
def test_the_stale_env_file_of_a_dead_up_is_not_used_and_the_error_names_the_way_out(
    tmp_path: Path, short: Path, started: list[Up]
) -> None:
    # Given an `up` killed outright: its up.json still names its pid and its servers,
    # which still listen, and its env file still holds their credentials
    home = short / "home"
    state_dir = short / "state"
    home.mkdir()
    up = Up(state_dir, home)
    started.append(up)
    up.wait_ready()
    assert up.cli("job", "list", "--json").returncode == 0
    up.proc.kill()
    up.proc.wait(10)
    assert json.loads((state_dir / "up.json").read_text())["pid"] == up.proc.pid
    assert up.cli("job", "list", "--json").returncode == 0  # the servers outlived it
    # When a shell that sourced nothing lists the jobs through that state dir
    stale = bare_cli(home, "job", "list", "--json", state_dir=state_dir)
    # Then the dead `up`'s settings are not used, and the one-line error says what to do
    assert stale.returncode == 1, stale.stdout + stale.stderr
    assert "cannot reach the database at postgresql+psycopg://rlfleet@localhost:5432" in (
        stale.stderr
    )
    assert WAY_OUT in stale.stderr
    assert len(stale.stderr.strip().splitlines()) == 1, stale.stderr
    # Nor when its pid was reused by another live process: nothing holds the lock
    state = json.loads((state_dir / "up.json").read_text())
    (state_dir / "up.json").write_text(json.dumps({**state, "pid": os.getpid()}))
    reused = bare_cli(home, "job", "list", "--json", state_dir=state_dir)
    assert reused.returncode == 1, reused.stdout + reused.stderr
    assert WAY_OUT in reused.stderr
