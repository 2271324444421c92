"""Commands on this machine (`LocalTransport`), for a VM that is the machine itself: a
`/bin/sh -c` in a session of its own, its output read as it arrives and capped
(`output_cap`) as over SSH.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

from scheduler.output_cap import CHUNK_BYTES, Tail, both, drain
from scheduler.transport_types import (
    STREAM_ERR_BYTES,
    CommandResult,
    TransportError,
    VMTarget,
    noted,
    output_limit,
)


async def _feed(proc: asyncio.subprocess.Process, input: str | None) -> None:
    """Write `input` to a local command's stdin and close it; a command that exits without
    reading it is no error."""
    if input is None or proc.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(input.encode())
        await proc.stdin.drain()
        proc.stdin.close()


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
        max_output: int | None = None,
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
        out, err = Tail(output_limit(max_output)), Tail(output_limit(max_output))
        assert proc.stdout is not None and proc.stderr is not None
        try:
            await asyncio.wait_for(
                both(
                    _feed(proc, input), drain(proc.stdout.read, out), drain(proc.stderr.read, err)
                ),
                timeout,
            )
            rc = await asyncio.wait_for(proc.wait(), timeout)
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
        return noted(target, CommandResult.of(128 - rc if rc < 0 else rc, out, err))

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

        async def pump() -> None:
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(CHUNK_BYTES):
                sink(chunk)

        err = Tail(STREAM_ERR_BYTES)
        try:
            await asyncio.wait_for(both(pump(), drain(proc.stderr.read, err)), timeout)
            rc = await proc.wait()
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, TimeoutError):
                raise TransportError(f"{target.name}: timed out after {timeout:.0f}s") from exc
            raise
        return (128 - rc if rc < 0 else rc), err.text()

    async def close(self) -> None:
        """Nothing to release."""

    def forget(self, target: VMTarget) -> None:
        """Nothing is kept per VM."""
