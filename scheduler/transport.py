"""How commands reach a VM: one small interface (`transport_types`), an SSH implementation
and a local one (`local_transport`).

Every caller goes through `Transport.run(target, command, timeout=…)`. Commands are
built by the caller with `shlex.quote` on every user-supplied piece
(docs/invariants.md, invariant 5). How one command travels over an open SSH connection
(a one-shot channel, the VM-side timeout, what a failure means) is `ssh_channel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

import asyncssh

from scheduler.liveness import SSHDeadlines
from scheduler.local_transport import LocalTransport
from scheduler.logging import get_logger
from scheduler.output_cap import CHUNK_BYTES, Tail, both, drain
from scheduler.ssh_channel import (
    dead_connection,
    describe,
    exit_status,
    remote_timeout_wrapper,
    run_once,
)
from scheduler.ssh_session import Session
from scheduler.transport_types import (
    STREAM_ERR_BYTES,
    CommandResult,
    Transport,
    TransportError,
    VMTarget,
    noted,
    output_limit,
)

__all__ = [
    "CommandResult",
    "HostKeyMismatch",
    "LocalTransport",
    "RoutingTransport",
    "SSHTransport",
    "Transport",
    "TransportError",
    "VMTarget",
    "make_transport",
]

log = get_logger("transport")


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
        self._sessions: dict[_ConnKey, Session] = {}
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
        max_output: int | None = None,
    ) -> CommandResult:
        """Run `command` on `target` over its pooled connection; `TransportError` on failure.

        `persistent` sends it to a long-lived `sh` on the VM instead of a new exec channel:
        one network round trip instead of three, for a command run every few seconds (the
        poll). The command runs in a subshell, so it cannot change the session's state.
        """
        wrapped = remote_timeout_wrapper(command, timeout) if self._remote_timeout else command
        limit = output_limit(max_output)
        if persistent and input is None:
            async with self._sem:
                return noted(target, await self._run_in_session(target, wrapped, timeout, limit))
        async with self._sem:
            stale = None
            for attempt in (1, 2):
                conn = await self._connection(target, stale=stale)
                try:
                    result = await asyncio.wait_for(run_once(conn, wrapped, input, limit), timeout)
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
                return noted(target, CommandResult.of(*result))
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
            err = Tail(STREAM_ERR_BYTES)
            try:

                async def pump() -> None:
                    while chunk := await process.stdout.read(CHUNK_BYTES):
                        sink(chunk)

                await asyncio.wait_for(both(pump(), drain(process.stderr.read, err)), timeout)
                result = await asyncio.wait_for(process.wait(check=False), timeout)
            except TimeoutError as exc:
                raise TransportError(f"{target.name}: timed out after {timeout:g}s") from exc
            except (OSError, asyncssh.Error) as exc:
                raise TransportError(f"{target.name}: {describe(exc)}") from exc
            finally:
                process.close()
            return exit_status(result), err.text()

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
        self, target: VMTarget, command: str, timeout: float, limit: int
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
                            conn.create_process("sh", encoding=None), timeout
                        )
                        session = Session(conn, process)
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
                return CommandResult.of(*await session.run(command, timeout, limit))
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
        max_output: int | None = None,
    ) -> CommandResult:
        """Run `command` on `target` with the transport its VM row names."""
        return await self._pick(target).run(
            target, command, timeout=timeout, input=input, persistent=persistent,
            max_output=max_output,
        )  # fmt: skip

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
