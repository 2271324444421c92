"""The state directory of `rlfleet up`: where its servers keep their data, the ports it
remembers (`up.json`), its secrets (mode 0600) and the lock that keeps a second `up` out.

Its own module so that the dashboard's server (which keeps its token here) and `up`
(which starts that server) both import it without importing each other."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from scheduler.embedded import free_port, postgres_system_user, write_private
from scheduler.errors import RlfleetError
from scheduler.logging import get_logger

log = get_logger("up")

STATE_FILE = "up.json"
LOCK_FILE = "up.lock"
ENV_FILE = "env"
PG_PASSWORD_FILE = "postgres.password"
NATS_TOKEN_FILE = "nats.token"


class AlreadyRunning(RlfleetError):
    """Another `rlfleet up` uses this state directory."""

    exit_code = 1


def default_state_dir() -> Path:
    """$XDG_DATA_HOME/rlfleet, else ~/.local/share/rlfleet."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "rlfleet"


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on `host:port` and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class StateDir:
    """The state directory: data of both servers, the remembered ports, a lock."""

    path: Path
    _lock: IO[str] | None = field(default=None, repr=False)

    @property
    def state_file(self) -> Path:
        """up.json: ports, URLs, and the pid of the `up` that runs (while it runs)."""
        return self.path / STATE_FILE

    def read(self) -> dict[str, Any]:
        """The remembered state; {} for a new or unreadable file."""
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write(self, data: dict[str, Any]) -> None:
        """Replace up.json atomically (mode 0600; it holds no secret, but no reason to share)."""
        write_private(self.state_file, json.dumps(data, indent=2) + "\n")

    @property
    def env_file(self) -> Path:
        """The file to `source`: the service URLs and their credentials (mode 0600)."""
        return self.path / ENV_FILE

    def secret(self, name: str) -> str:
        """The secret kept in file `name` (mode 0600), generated on first use."""
        path = self.path / name
        with contextlib.suppress(OSError, UnicodeError):
            value = path.read_text(encoding="utf-8").strip()
            if value:
                path.chmod(0o600)
                return value
        value = secrets.token_urlsafe(32)
        write_private(path, value + "\n")
        return value

    def secure(self) -> None:
        """Make the directory private: 0700, or 0710 with the PostgreSQL system user's group
        when running as root (that user must pass through to its data directory)."""
        self.path.chmod(0o700)
        entry = postgres_system_user()
        if entry is not None:
            os.chown(self.path, -1, entry.pw_gid)
            self.path.chmod(0o710)

    def lock(self) -> None:
        """Take the directory for this process, or raise `AlreadyRunning`."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.secure()
        handle = open(self.path / LOCK_FILE, "a+")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            handle.close()
            pid = self.read().get("pid")
            raise AlreadyRunning(
                f"another `rlfleet up` (pid {pid or '?'}) uses {self.path}; "
                "stop it first or pass another --state-dir"
            ) from exc
        self._lock = handle

    def unlock(self) -> None:
        """Release the directory."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def pick_port(self, service: str) -> int:
        """The remembered port of `service` when it is free, else a new free one."""
        remembered = self.read().get("ports", {}).get(service)
        if isinstance(remembered, int) and port_is_free(remembered):
            return remembered
        if remembered:
            log.warning("port_taken", service=service, port=remembered)
        return free_port()
