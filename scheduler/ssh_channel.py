"""How one command travels over an open asyncssh connection, and how its answer is read:
a one-shot channel (`run_once`, its `exit_status`), the limit the VM itself
puts on a command (`remote_timeout_wrapper`), and what a failure means
(`dead_connection`, `describe`). `transport.SSHTransport` pools the connections.
"""

from __future__ import annotations

import math
import shlex
import signal

import asyncssh

from scheduler.output_cap import Tail, both, drain


def remote_timeout_wrapper(command: str, timeout: float) -> str:
    """`command` wrapped so the VM itself kills it after `timeout` (+ a little) seconds.

    The local timeout closes the channel, but OpenSSH does not kill a command without a
    tty when its channel closes, so the VM enforces the limit too when it has `timeout`.
    """
    limit = max(1, math.ceil(timeout) + 1)
    inner = shlex.quote(command)
    return (
        f"if command -v timeout >/dev/null 2>&1; then exec timeout -k 5 {limit} /bin/sh -c {inner};"
        f" else exec /bin/sh -c {inner}; fi"
    )


async def run_once(
    conn: asyncssh.SSHClientConnection, command: str, input: str | None, limit: int
) -> tuple[int, Tail, Tail]:
    """Run `command` on a channel of its own: its exit status, and the last `limit` bytes
    of each of its stdout and stderr (`output_cap.Tail`), both read as they arrive. Bytes,
    decoded only at the end: a log tail cut inside a multi-byte character must not be a
    protocol error that closes the VM's whole connection."""
    process = await conn.create_process(command, encoding=None)
    try:
        if input is not None:
            process.stdin.write(input.encode())
            process.stdin.write_eof()
        out, err = Tail(limit), Tail(limit)
        await both(drain(process.stdout.read, out), drain(process.stderr.read, err))
        return exit_status(await process.wait(check=False)), out, err
    finally:
        # On timeout or cancellation, close the channel rather than leave it half open.
        process.close()


def dead_connection(conn: asyncssh.SSHClientConnection, exc: BaseException) -> bool:
    """Whether a failed channel open means the connection is gone. A live connection that
    refuses a channel (OpenSSH's MaxSessions reached by commands running on it) is not:
    closing it would kill those commands."""
    if conn.is_closed() or isinstance(exc, asyncssh.ConnectionLost):
        return True
    return getattr(exc, "code", None) != asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED


def describe(exc: BaseException) -> str:
    if isinstance(exc, asyncssh.DisconnectError | asyncssh.ChannelOpenError):
        return exc.reason or type(exc).__name__
    return str(exc).strip() or type(exc).__name__


def exit_status(result: asyncssh.SSHCompletedProcess) -> int:
    """The shell's convention: the exit code, or 128 + N when killed by signal N."""
    if result.exit_status is not None and result.exit_status >= 0:
        return result.exit_status
    if result.exit_signal:
        signame = result.exit_signal[0]
        num = getattr(signal, f"SIG{signame}", None)
        return 128 + int(num) if num is not None else 255
    return 255
