"""How a command finds a running `rlfleet up` when no database is configured: the state
directory ($RLFLEET_STATE_DIR, else up's default), alive only while its `up` holds the lock
and its pid lives; then its env file, private to this user, gives the URLs and the token.

Loads no database layer: `job list` stays fast."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler.errors import BadInput
from scheduler.statedir import ENV_FILE, LOCK_FILE, StateDir, default_state_dir

if TYPE_CHECKING:
    from scheduler.settings import Settings

STATE_DIR_ENV = "RLFLEET_STATE_DIR"
WAY_OUT = "is `rlfleet up` running? start it, or set RLFLEET_DATABASE_URL / source STATE_DIR/env"
"""What a connection error adds when no database was configured and no `up` was found."""


@dataclass(frozen=True)
class FoundUp:
    """A running `up`: its state directory and the variables of its env file."""

    state_dir: Path
    values: dict[str, str]


def configured_state_dir() -> Path:
    """$RLFLEET_STATE_DIR, else `up`'s default state directory."""
    return Path(os.environ.get(STATE_DIR_ENV) or default_state_dir()).expanduser()


def find_running_up(path: Path | None = None) -> FoundUp | None:
    """The `up` that runs on `path` (default: `configured_state_dir()`), or None when
    none does (no state, a stale one). `BadInput` for an env file others could have written."""
    state = StateDir(path if path is not None else configured_state_dir())
    if not up_is_alive(state):
        return None
    return FoundUp(state.path, read_private_env_file(state.path / ENV_FILE))


def up_is_alive(state: StateDir) -> bool:
    """Whether the `up` that up.json names still runs: its pid is a live process of this
    user, and the directory's lock is held (a dead `up` holds no lock: its file is stale)."""
    pid = state.read().get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's
        return False
    return lock_is_held(state.path / LOCK_FILE)


def lock_is_held(path: Path) -> bool:
    """Whether a process holds the exclusive lock of `path` (tested with a shared lock,
    released at once; never blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


MAX_ENV_FILE_BYTES = 64 * 1024
"""The most an env file `up` writes could hold (a few URLs and credentials): a larger one
is not `up`'s."""


def read_private_env_file(path: Path) -> dict[str, str]:
    """The variables of an env file that only this user can have written: owned by this
    user, a regular file (no link), not group- or world-writable; `BadInput` otherwise."""
    try:
        # O_NONBLOCK: a FIFO in its place is opened at once (then refused), never waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise BadInput(
            f"cannot read the env file of `rlfleet up` ({path}): {exc.strerror}"
        ) from exc
    with os.fdopen(fd, encoding="utf-8") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise BadInput(f"refusing {path}: not a regular file owned by you")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise BadInput(f"refusing {path}: writable by others (chmod 600 it, or restart up)")
        if info.st_size > MAX_ENV_FILE_BYTES:
            raise BadInput(f"refusing {path}: larger than {MAX_ENV_FILE_BYTES} bytes")
        try:
            return parse_env_text(handle.read(MAX_ENV_FILE_BYTES))
        except (UnicodeError, ValueError) as exc:
            raise BadInput(f"cannot parse {path}: {exc.__class__.__name__}") from exc


def read_env_file(path: Path) -> dict[str, str]:
    """The variables an `env` file written by `write_env_file` sets (parsed, not run)."""
    return parse_env_text(path.read_text(encoding="utf-8"))


def parse_env_text(text: str) -> dict[str, str]:
    """The `export KEY=value` lines of an env file (parsed, never run)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            values[key] = value
    return values


def cli_settings(
    database_url: str | None, nats_url: str | None
) -> tuple[Settings, FoundUp | None, bool]:
    """The settings of a command: as given (flags, environment) when a database is
    configured; else those of the running `up` (the flags and environment still win for
    NATS); else the defaults. Also the `up` found, and whether a database was configured."""
    from scheduler.settings import DATABASE_URL_ENV, NATS_TOKEN_ENV, NATS_URL_ENV, Settings

    if database_url or os.environ.get(DATABASE_URL_ENV):
        return Settings.load(database_url, nats_url), None, True
    found = find_running_up()
    if found is None:
        return Settings.load(database_url, nats_url), None, False
    settings = Settings.load(
        found.values.get(DATABASE_URL_ENV),
        nats_url or os.environ.get(NATS_URL_ENV) or found.values.get(NATS_URL_ENV),
    )
    token = settings.nats_token or found.values.get(NATS_TOKEN_ENV) or None
    return replace(settings, nats_token=token), found, False
