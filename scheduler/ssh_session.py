"""The persistent shell `transport.SSHTransport` keeps on a VM for a command it runs often
(the poll): one long-lived `sh` that runs one framed command at a time.

Each request runs the command in a subshell with stdin from /dev/null, then prints an end
marker carrying a fresh token and the exit status on stdout, and the marker on stderr, so
both streams can be read up to exactly this command's end. Both are read at once, in
bounded chunks (`output_cap`): a marker is looked for in a window of what arrived, and
what cannot hold one any more goes to the command's `Tail`, which keeps its last bytes and
counts the rest. Output of any size, holding lookalike markers or not, costs the reader a
bounded amount of memory.
"""

from __future__ import annotations

import asyncio
import re
import secrets

import asyncssh

from scheduler.output_cap import CHUNK_BYTES, OUTPUT_LIMIT, Tail, both

SESSION_END = "__rlfleet_end_"
_TOKEN_HEX = 16
_RC_DIGITS = 11
# Any request's end marker, compiled once. A match whose token is not this request's is
# output: the search goes on from its next byte (a lookalike may overlap the real one).
_OUT_END = re.compile(
    rf"\n{SESSION_END}([0-9a-f]{{{_TOKEN_HEX}}}) (-?[0-9]{{1,{_RC_DIGITS}}})\n".encode()
)
_ERR_END = re.compile(rf"\n{SESSION_END}([0-9a-f]{{{_TOKEN_HEX}}})\n".encode())
_KEEP = len(SESSION_END) + _TOKEN_HEX + _RC_DIGITS + 3
"""Bytes a window keeps unsearched past its last read: at least a marker's length - 1."""


class FramedStream:
    """One stream (stdout or stderr) of the session, read up to a request's end marker."""

    def __init__(self, reader: asyncssh.SSHReader[bytes]) -> None:
        self.reader = reader
        self.pending = bytearray()

    async def read_to(
        self, pattern: re.Pattern[bytes], token: bytes, tail: Tail
    ) -> re.Match[bytes]:
        """Read up to this request's marker (`pattern` with `token`), what comes before it
        into `tail`; the marker's match. `EOFError` when the stream ends first."""
        window = self.pending
        while True:
            found = pattern.search(window)
            while found is not None and found.group(1) != token:
                found = pattern.search(window, found.start() + 1)
            if found is not None:
                tail.add(memoryview(window)[: found.start()])
                self.pending = bytearray(window[found.end() :])
                return found
            # Only the last `_KEEP` bytes can begin a marker not yet complete.
            cut = max(0, len(window) - _KEEP)
            tail.add(memoryview(window)[:cut])
            del window[:cut]
            chunk = await self.reader.read(CHUNK_BYTES)
            if not chunk:
                raise EOFError("the session's shell ended")
            window += chunk


class Session:
    """A long-lived `sh` on a VM running one framed command at a time. Any error or timeout
    closes it; the next command starts a new one."""

    def __init__(
        self, conn: asyncssh.SSHClientConnection, process: asyncssh.SSHClientProcess[bytes]
    ) -> None:
        self.conn = conn
        self.process = process
        self.stdout = FramedStream(process.stdout)
        self.stderr = FramedStream(process.stderr)
        self.lock = asyncio.Lock()
        self.closed = False

    async def run(
        self, command: str, timeout: float, limit: int = OUTPUT_LIMIT
    ) -> tuple[int, Tail, Tail]:
        """Run one command: its exit status, stdout and stderr (each its last `limit`
        bytes); the session is closed if it fails or times out."""
        token = secrets.token_hex(_TOKEN_HEX // 2)
        end = f"{SESSION_END}{token}"
        request = (
            f"( {command}\n) </dev/null; rlfleet_rc=$?; "
            f"printf '\\n%s %d\\n' {end} \"$rlfleet_rc\"; printf '\\n%s\\n' {end} >&2\n"
        )
        async with self.lock:
            try:
                return await asyncio.wait_for(
                    self._exchange(request, token.encode(), limit), timeout
                )
            except BaseException:
                self.close()
                raise

    async def _exchange(self, request: str, token: bytes, limit: int) -> tuple[int, Tail, Tail]:
        self.process.stdin.write(request.encode())
        out, err = Tail(limit), Tail(limit)
        found, _ = await both(
            self.stdout.read_to(_OUT_END, token, out), self.stderr.read_to(_ERR_END, token, err)
        )
        return int(found.group(2)), out, err

    def close(self) -> None:
        """End the remote shell's channel."""
        self.closed = True
        self.process.close()
