"""How commands reach a VM: one small interface, an SSH implementation and a local one.

Every caller goes through `Transport.run(target, command, timeout=…)`. Commands are
built by the caller with `shlex.quote` on every user-supplied piece
(docs/invariants.md, invariant 5). How one command travels over an open SSH connection
(a one-shot channel, the VM-side timeout, what a failure means) is `ssh_channel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import secrets
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import asyncssh

from scheduler.liveness import SSHDeadlines
from scheduler.logging import get_logger
from scheduler.models import DEFAULT_ENTRYPOINT, VM
from scheduler.ssh_channel import (
    dead_connection,
    describe,
    exit_status,
    remote_timeout_wrapper,
    run_once,
    text,
)

log = get_logger("transport")


@dataclass(frozen=True)
class VMTarget:
    """Everything needed to reach one VM, detached from any database session."""

    id: int
    name: str
    host: str
    port: int = 22
    user: str | None = None
    ssh_key_path: str | None = None
    known_hosts: str | None = None
    verify_host_key: bool = True
    transport: str = "ssh"
    python: str = "python3"
    entrypoint: str = DEFAULT_ENTRYPOINT
    internal_address: str | None = None
    """Where the other nodes of a multi-node job reach this VM; None: `host`."""
    job_user: str | None = None
    """The account its jobs run as (`scheduler.remote.jobuser`), as the row holds it:
    checked (`check_job_user`) by whatever puts it into shell text."""

    @property
    def training_address(self) -> str:
        """The address for training traffic: `internal_address`, else `host`."""
        return self.internal_address or self.host

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of the fields, which are also the VM columns they come from."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def columns(cls) -> list[Any]:
        """The VM columns to select for `from_row`: one query loads many targets."""
        return [getattr(VM, name) for name in cls.fields()]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> VMTarget:
        """A target from a row that starts with `columns()`, in that order."""
        return cls(**dict(zip(cls.fields(), row, strict=False)))

    @classmethod
    def from_vm(cls, vm: VM) -> VMTarget:
        """Copy the connection fields out of a VM row."""
        return cls(**{name: getattr(vm, name) for name in cls.fields()})


@dataclass(frozen=True)
class CommandResult:
    """What a remote command returned."""

    exit_status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_status == 0


class TransportError(Exception):
    """The VM could not be reached, or the command did not finish in time."""


class Transport(Protocol):
    """Runs shell commands on VMs."""

    async def run(
        self,
        target: VMTarget,
        command: str,
        *,
        timeout: float,
        input: str | None = None,
        persistent: bool = False,
    ) -> CommandResult:
        """Run `command` in a POSIX shell on `target`; raise `TransportError` if unreachable.

        `persistent` is a hint that the command is repeated often (the poll): a transport
        may keep a shell open on the VM for it.
        """
        ...

    async def close(self) -> None:
        """Release every connection."""
        ...


class LocalTransport:
    """Runs commands on this machine with `/bin/sh -c`, for a VM that is the machine itself."""

    async def run(
        self,
        target: VMTarget,
        command: str,
        *,
        timeout: float,
        input: str | None = None,
        persistent: bool = False,
    ) -> CommandResult:
        """Run `command` locally; its process group is killed on timeout or cancellation
        (`persistent` is moot)."""
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(input.encode() if input is not None else None), timeout
            )
        except BaseException as exc:
            # Timed out, or cancelled (a daemon stopping): never leave the group running.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, TimeoutError):
                raise TransportError(
                    f"{target.name}: command timed out after {timeout:.0f}s"
                ) from exc
            raise
        # The shell's convention, as over SSH: 128 + N for a death by signal N.
        rc = proc.returncode if proc.returncode is not None else 255
        return CommandResult(
            128 - rc if rc < 0 else rc, out.decode(errors="replace"), err.decode(errors="replace")
        )

    async def stream(
        self, target: VMTarget, command: str, sink: Callable[[bytes], None], *, timeout: float
    ) -> tuple[int, str]:
        """Run `command` locally, its stdout's bytes handed to `sink` as they come; its
        exit status and the end of its stderr."""
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None

        async def pump() -> bytes:
            assert proc.stdout is not None and proc.stderr is not None
            while chunk := await proc.stdout.read(1 << 20):
                sink(chunk)
            return await proc.stderr.read(1 << 16)

        try:
            err = await asyncio.wait_for(pump(), timeout)
            rc = await proc.wait()
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, TimeoutError):
                raise TransportError(f"{target.name}: timed out after {timeout:.0f}s") from exc
            raise
        return (128 - rc if rc < 0 else rc), err.decode(errors="replace")[-2000:]

    async def close(self) -> None:
        """Nothing to release."""

    def forget(self, target: VMTarget) -> None:
        """Nothing is kept per VM."""


# Fast, widely supported algorithms first (key exchange is the CPU-heavy part of a
# connect); the rest of asyncssh's defaults follow so that older servers still connect.
_PREFERRED_KEX = ("curve25519-sha256", "curve25519-sha256@libssh.org")
# AES-GCM first: with AES-NI it costs one library call per packet, where asyncssh's
# chacha20-poly1305 builds several cipher contexts per packet.
_PREFERRED_CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
)


def _prefer(preferred: tuple[str, ...], defaults: list[bytes]) -> list[str]:
    names = [d.decode() for d in defaults if not d.startswith(b"gss-")]
    return [p for p in preferred if p in names] + [n for n in names if n not in preferred]


CLOSE_WAIT_S = 2.0
"""How long `close()` waits for VMs to acknowledge the end of their connections."""


class HostKeyMismatch(TransportError):
    """The VM's host key is not the one in known_hosts: refusing to talk to it."""


_ConnKey = tuple[str, int, str | None, str | None, str | None, bool]


class SSHTransport:
    """An asyncssh connection pool: one connection per VM, reused across commands.

    Connections are opened lazily under a per-VM lock (no duplicate connects), reopened
    when closed, and kept alive with keepalives. A global semaphore bounds concurrent
    connects plus commands. Host keys are verified against the VM's known_hosts file
    (default ~/.ssh/known_hosts) unless the VM says `verify_host_key = False`.

    Nothing waits on a VM without a deadline: connecting (TCP, handshake and login) has
    `connect_timeout`, opening a channel and running a command have the command's
    `timeout`, and keepalives close a connection that stops answering within
    `keepalive_interval * (keepalive_count_max + 1)` seconds. A connection on which a
    deadline passed is abandoned (aborted, never closed gracefully: a silent peer would
    never acknowledge a close), so the next command reconnects.
    """

    def __init__(
        self,
        *,
        max_concurrency: int = 200,
        connect_timeout: float | None = None,
        login_timeout: float | None = None,
        keepalive_interval: float | None = None,
        keepalive_count_max: int | None = None,
        remote_timeout: bool = True,
    ) -> None:
        # Unset deadlines come from the environment (RLFLEET_SSH_*), else the defaults:
        # every daemon then bounds a silent VM the same way (scheduler/liveness.py).
        deadlines = SSHDeadlines.from_env()
        connect_timeout = connect_timeout or deadlines.connect_timeout_s
        keepalive_interval = keepalive_interval or deadlines.keepalive_interval_s
        keepalive_count_max = keepalive_count_max or deadlines.keepalive_count_max
        self._conns: dict[_ConnKey, asyncssh.SSHClientConnection] = {}
        self._locks: dict[_ConnKey, asyncio.Lock] = {}
        self._sem = asyncio.Semaphore(max_concurrency)
        self._connect_timeout = connect_timeout
        self._login_timeout = login_timeout or connect_timeout
        self._keepalive_interval = keepalive_interval
        self._keepalive_count_max = keepalive_count_max
        self._remote_timeout = remote_timeout
        self._sessions: dict[_ConnKey, _Session] = {}
        self._session_locks: dict[_ConnKey, asyncio.Lock] = {}
        self._files: dict[tuple[str, Callable[[str], Any]], tuple[tuple[int, int], Any]] = {}
        self._kex = _prefer(_PREFERRED_KEX, asyncssh.kex.get_default_kex_algs())
        self._ciphers = _prefer(
            _PREFERRED_CIPHERS, asyncssh.encryption.get_default_encryption_algs()
        )

    def _load(self, path: str, loader: Callable[[str], Any]) -> Any:
        """`loader(path)`, cached until the file changes: a fleet often shares one
        known_hosts file and one key, and parsing them on every connect is wasted CPU."""
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._files.get((path, loader))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = loader(path)
        self._files[(path, loader)] = (stamp, value)
        return value

    @staticmethod
    def _key(target: VMTarget) -> _ConnKey:
        return (
            target.host,
            target.port,
            target.user,
            target.ssh_key_path,
            target.known_hosts,
            target.verify_host_key,
        )

    def forget(self, target: VMTarget) -> None:
        """Close the pooled connection (and shell) to `target`: no command is expected
        there for a while (its VM went to another poller). A command still running on it
        fails; the next one connects anew."""
        key = self._key(target)
        session = self._sessions.pop(key, None)
        if session is not None:
            session.close()
        conn = self._conns.pop(key, None)
        if conn is not None:
            conn.close()

    @property
    def open_connections(self) -> int:
        """How many pooled connections are open now."""
        return sum(1 for c in self._conns.values() if not c.is_closed())

    async def _connect(self, target: VMTarget) -> asyncssh.SSHClientConnection:
        options: dict[str, Any] = {
            "port": target.port,
            "connect_timeout": self._connect_timeout,
            "login_timeout": self._login_timeout,
            "keepalive_interval": self._keepalive_interval,
            "keepalive_count_max": self._keepalive_count_max,
            "kex_algs": self._kex,
            "encryption_algs": self._ciphers,
        }
        if target.user:
            options["username"] = target.user
        try:
            if target.ssh_key_path:
                # Only the VM's own key: no agent, no guessing among ~/.ssh keys.
                options["client_keys"] = self._load(
                    os.path.expanduser(target.ssh_key_path), asyncssh.load_keypairs
                )
                options["agent_path"] = None
            if target.verify_host_key and target.known_hosts:
                options["known_hosts"] = self._load(
                    os.path.expanduser(target.known_hosts), asyncssh.read_known_hosts
                )
        except (OSError, ValueError, asyncssh.Error) as exc:
            raise TransportError(f"{target.name}: {describe(exc)}") from exc
        if not target.verify_host_key:
            log.warning(
                "ssh_host_key_not_verified",
                vm=target.name,
                host=target.host,
                port=target.port,
                detail="verify_host_key is off for this VM: any host key is accepted",
            )
            options["known_hosts"] = None
        try:
            # asyncssh's connect_timeout covers TCP, key exchange and login; the outer
            # deadline is a second line against any step that would wait on a silent peer.
            conn = await asyncio.wait_for(
                asyncssh.connect(target.host, **options), self._connect_timeout + 1
            )
        except asyncssh.HostKeyNotVerifiable as exc:
            raise HostKeyMismatch(
                f"{target.name}: host key of {target.host}:{target.port} not verified "
                f"against {target.known_hosts or '~/.ssh/known_hosts'}: {exc.reason}"
            ) from exc
        except TimeoutError as exc:
            raise TransportError(
                f"{target.name}: cannot connect to {target.host}:{target.port}: no answer "
                f"within {self._connect_timeout:g}s"
            ) from exc
        except (OSError, asyncssh.Error) as exc:
            raise TransportError(
                f"{target.name}: cannot connect to {target.host}:{target.port}: {describe(exc)}"
            ) from exc
        log.debug("ssh_connected", vm=target.name, host=target.host, port=target.port)
        return conn

    async def _connection(
        self, target: VMTarget, *, stale: asyncssh.SSHClientConnection | None = None
    ) -> asyncssh.SSHClientConnection:
        """The VM's pooled connection, opened if there is none or it is closed. `stale`:
        a connection a command just failed on, replaced if it is still the pooled one (a
        concurrent caller may have replaced it already: that new one is left alone, with
        whatever runs on it)."""
        key = self._key(target)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._conns.get(key)
            if conn is not None and (conn is stale or conn.is_closed()):
                conn.abort()  # a dead or failed connection: nothing to close gracefully
                conn = None
                del self._conns[key]
            if conn is None:
                conn = await self._connect(target)
                self._conns[key] = conn
            return conn

    async def run(
        self,
        target: VMTarget,
        command: str,
        *,
        timeout: float,
        input: str | None = None,
        persistent: bool = False,
    ) -> CommandResult:
        """Run `command` on `target` over its pooled connection; `TransportError` on failure.

        `persistent` sends it to a long-lived `sh` on the VM instead of a new exec channel:
        one network round trip instead of three, for a command run every few seconds (the
        poll). The command runs in a subshell, so it cannot change the session's state.
        """
        wrapped = remote_timeout_wrapper(command, timeout) if self._remote_timeout else command
        if persistent and input is None:
            async with self._sem:
                return await self._run_in_session(target, wrapped, timeout)
        async with self._sem:
            stale = None
            for attempt in (1, 2):
                conn = await self._connection(target, stale=stale)
                try:
                    result = await asyncio.wait_for(run_once(conn, wrapped, input), timeout)
                except (asyncssh.ChannelOpenError, asyncssh.ConnectionLost) as exc:
                    # The pooled connection died under us (VM rebooted, network blip): the
                    # command never started, so reconnecting once and retrying is safe.
                    opened = isinstance(exc, asyncssh.ChannelOpenError)
                    if attempt == 1 and opened and dead_connection(conn, exc):
                        stale = conn
                        continue
                    raise TransportError(f"{target.name}: {describe(exc)}") from exc
                except TimeoutError as exc:
                    self._abandon(target, conn, f"command timed out after {timeout:g}s")
                    raise TransportError(
                        f"{target.name}: command timed out after {timeout:g}s"
                    ) from exc
                except (OSError, asyncssh.Error) as exc:
                    raise TransportError(f"{target.name}: {describe(exc)}") from exc
                return CommandResult(exit_status(result), text(result.stdout), text(result.stderr))
        raise AssertionError("unreachable")  # pragma: no cover

    async def stream(
        self, target: VMTarget, command: str, sink: Callable[[bytes], None], *, timeout: float
    ) -> tuple[int, str]:
        """Run `command` on `target` on an exec channel of its own, its stdout's bytes (not
        text) handed to `sink` as they come (`job pull`); its exit status and the end of
        its stderr. `TransportError` on failure."""
        async with self._sem:
            conn = await self._connection(target)
            try:
                process = await conn.create_process(command, encoding=None)
            except (OSError, asyncssh.Error) as exc:
                raise TransportError(f"{target.name}: {describe(exc)}") from exc
            try:

                async def pump() -> bytes:
                    while chunk := await process.stdout.read(1 << 20):
                        sink(chunk)
                    return await process.stderr.read(1 << 16)

                err = await asyncio.wait_for(pump(), timeout)
                result = await asyncio.wait_for(process.wait(check=False), timeout)
            except TimeoutError as exc:
                raise TransportError(f"{target.name}: timed out after {timeout:g}s") from exc
            except (OSError, asyncssh.Error) as exc:
                raise TransportError(f"{target.name}: {describe(exc)}") from exc
            finally:
                process.close()
            return exit_status(result), bytes(err).decode(errors="replace")[-2000:]

    def _abandon(self, target: VMTarget, conn: asyncssh.SSHClientConnection, why: str) -> None:
        """Drop `conn` (and its shell) from the pool and abort it, without waiting on the VM:
        a deadline passed on it, and a connection that stopped answering must not hold
        anything up. Commands still running on it fail; their callers try again."""
        key = self._key(target)
        if self._conns.get(key) is conn:
            del self._conns[key]
        session = self._sessions.get(key)
        if session is not None and session.conn is conn:
            del self._sessions[key]
            session.close()
        if not conn.is_closed():
            log.info("ssh_connection_abandoned", vm=target.name, why=why)
        conn.abort()

    async def _run_in_session(
        self, target: VMTarget, command: str, timeout: float
    ) -> CommandResult:
        key = self._key(target)
        stale = None
        for attempt in (1, 2):
            conn = await self._connection(target, stale=stale)
            # One shell per VM: two commands that both find none must not both open one
            # (the loser's would be dropped from the pool, open on the VM for good).
            async with self._session_locks.setdefault(key, asyncio.Lock()):
                session = self._sessions.get(key)
                if session is None or session.conn is not conn or session.closed:
                    if session is not None:
                        session.close()
                    try:
                        # Opening a channel waits on the VM too: the command's deadline.
                        process = await asyncio.wait_for(
                            conn.create_process("sh", encoding="utf-8", errors="replace"), timeout
                        )
                        session = _Session(conn, process)
                    except TimeoutError as exc:
                        self._abandon(target, conn, f"no shell within {timeout:g}s")
                        raise TransportError(
                            f"{target.name}: no answer to a channel open within {timeout:g}s"
                        ) from exc
                    except (asyncssh.ChannelOpenError, asyncssh.ConnectionLost) as exc:
                        if attempt == 1 and dead_connection(conn, exc):
                            stale = conn
                            continue  # the pooled connection died: reconnect once
                        raise TransportError(f"{target.name}: {describe(exc)}") from exc
                    except (OSError, asyncssh.Error) as exc:
                        raise TransportError(f"{target.name}: {describe(exc)}") from exc
                    self._sessions[key] = session
            try:
                return await session.run(command, timeout)
            except TimeoutError as exc:
                self._abandon(target, conn, f"command timed out after {timeout:g}s")
                raise TransportError(
                    f"{target.name}: command timed out after {timeout:g}s"
                ) from exc
            except (OSError, asyncssh.Error, EOFError, asyncio.IncompleteReadError) as exc:
                raise TransportError(f"{target.name}: session lost: {describe(exc)}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        """Close every pooled connection: gracefully where the VM answers, else aborted."""
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()
        conns = list(self._conns.values())
        self._conns.clear()
        for conn in conns:
            conn.close()
        if conns:
            # A silent VM never acknowledges a close: wait a little, then abort the rest.
            with contextlib.suppress(Exception):
                await asyncio.wait(
                    [asyncio.ensure_future(c.wait_closed()) for c in conns], timeout=CLOSE_WAIT_S
                )
        for conn in conns:
            conn.abort()


SESSION_END = "__rlfleet_end_"
_TOKEN_HEX = 16
# Any request's end marker, compiled once: a separator string would be compiled into a new
# regex by every read (each request's token is new, so never from re's cache), about a
# quarter of a poll's CPU. A match whose token is not this request's is output, read on.
_OUT_END = re.compile(rf"\n{SESSION_END}[0-9a-f]{{{_TOKEN_HEX}}} ")
_ERR_END = re.compile(rf"\n{SESSION_END}[0-9a-f]{{{_TOKEN_HEX}}}\n")
_END_LEN = len(SESSION_END) + _TOKEN_HEX + 2


class _Session:
    """A long-lived `sh` on a VM that runs one framed command at a time.

    Each request runs the command in a subshell with stdin from /dev/null, then prints an
    end marker carrying a fresh token and the exit status on stdout, and the marker on
    stderr, so both streams can be read up to exactly this command's end. Any error or
    timeout closes the session; the next command starts a new one.
    """

    def __init__(
        self, conn: asyncssh.SSHClientConnection, process: asyncssh.SSHClientProcess[str]
    ) -> None:
        self.conn = conn
        self.process = process
        self.lock = asyncio.Lock()
        self.closed = False

    async def run(self, command: str, timeout: float) -> CommandResult:
        """Run one command; the session is closed if it fails or times out."""
        end = f"{SESSION_END}{secrets.token_hex(_TOKEN_HEX // 2)}"
        request = (
            f"( {command}\n) </dev/null; rlfleet_rc=$?; "
            f"printf '\\n%s %d\\n' {end} \"$rlfleet_rc\"; printf '\\n%s\\n' {end} >&2\n"
        )
        async with self.lock:
            try:
                return await asyncio.wait_for(self._exchange(request, end), timeout)
            except BaseException:
                self.close()
                raise

    async def _exchange(self, request: str, end: str) -> CommandResult:
        self.process.stdin.write(request)
        out = await _read_to_end(self.process.stdout, _OUT_END, f"\n{end} ")
        rc = (await self.process.stdout.readline()).strip()
        err = await _read_to_end(self.process.stderr, _ERR_END, f"\n{end}\n")
        return CommandResult(
            int(rc) if rc.lstrip("-").isdigit() else 255,
            out[: -len(end) - 2],
            err[: -len(end) - 2],
        )

    def close(self) -> None:
        """End the remote shell's channel."""
        self.closed = True
        self.process.close()


async def _read_to_end(stream: asyncssh.SSHReader[str], any_end: re.Pattern[str], end: str) -> str:
    """Read `stream` up to and including `end` (this request's marker), with `any_end`
    (every marker's shape, compiled once) as the separator."""
    parts = []
    while True:
        part = await stream.readuntil(any_end, _END_LEN)
        parts.append(part)
        if part.endswith(end):
            return "".join(parts)


class RoutingTransport:
    """Sends `transport == "local"` targets to a `LocalTransport`, the rest over SSH."""

    def __init__(self, local: Transport, ssh: Transport) -> None:
        self.local = local
        self.ssh = ssh

    def _pick(self, target: VMTarget) -> Transport:
        return self.local if target.transport == "local" else self.ssh

    async def run(
        self,
        target: VMTarget,
        command: str,
        *,
        timeout: float,
        input: str | None = None,
        persistent: bool = False,
    ) -> CommandResult:
        """Run `command` on `target` with the transport its VM row names."""
        return await self._pick(target).run(
            target, command, timeout=timeout, input=input, persistent=persistent
        )

    async def stream(
        self, target: VMTarget, command: str, sink: Callable[[bytes], None], *, timeout: float
    ) -> tuple[int, str]:
        """`stream` with the transport the VM row names."""
        picked = self._pick(target)
        assert isinstance(picked, LocalTransport | SSHTransport)
        return await picked.stream(target, command, sink, timeout=timeout)

    def forget(self, target: VMTarget) -> None:
        """Close what the transport of `target` keeps open to it."""
        forget = getattr(self._pick(target), "forget", None)
        if forget is not None:
            forget(target)

    async def close(self) -> None:
        """Close both transports."""
        await self.ssh.close()
        await self.local.close()


def make_transport(**ssh_options: Any) -> RoutingTransport:
    """The transport every daemon uses: local for `local` VMs, pooled SSH otherwise."""
    return RoutingTransport(LocalTransport(), SSHTransport(**ssh_options))
