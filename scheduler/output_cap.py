"""How much of a command's output is kept: every transport reads a command's stdout and
stderr in bounded chunks, as they arrive, into a `Tail` that keeps the last `limit`
bytes and counts the rest. A command printing gigabytes (a job's file read by a script, a
link to /dev/zero) costs the reader `limit` bytes, never its whole output
(docs/invariants.md, invariant 9).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

OUTPUT_LIMIT = 1 << 20
"""Default most bytes of each of a command's stdout and stderr that are kept (the tail)."""
CHUNK_BYTES = 1 << 16
"""Most bytes one read of a command's output takes."""


class Tail:
    """The last `limit` bytes of a stream, and how many came before them (`dropped`)."""

    def __init__(self, limit: int = OUTPUT_LIMIT) -> None:
        self.limit = max(0, int(limit))
        self.total = 0
        self._buf = bytearray()

    def add(self, data: bytes | bytearray | memoryview) -> None:
        """Take `data`; what falls out of the last `limit` bytes is only counted."""
        size = len(data)
        self.total += size
        if size >= self.limit:
            self._buf = bytearray(data[size - self.limit :]) if self.limit else bytearray()
            return
        self._buf += data
        # Trimmed once it holds twice the limit: a memmove per 2x, not one per chunk.
        if len(self._buf) > 2 * self.limit:
            del self._buf[: len(self._buf) - self.limit]

    def value(self) -> bytes:
        """The bytes kept: the last `limit` of those taken."""
        return bytes(self._buf[max(0, len(self._buf) - self.limit) :]) if self.limit else b""

    @property
    def dropped(self) -> int:
        """How many bytes were taken but not kept."""
        return self.total - min(len(self._buf), self.limit)

    def text(self) -> str:
        """The bytes kept as text; undecodable bytes (a cut character) become U+FFFD."""
        return self.value().decode(errors="replace")


async def drain(read: Callable[[int], Awaitable[Any]], tail: Tail) -> None:
    """Read a stream to its end with `read(CHUNK_BYTES)` into `tail`."""
    while chunk := await read(CHUNK_BYTES):
        tail.add(chunk)


async def both(*steps: Awaitable[Any]) -> list[Any]:
    """Run `steps` concurrently, their results in order; when one fails or the caller is
    cancelled, the others are cancelled too (never left reading a stream).

    A command's stdout and stderr are read together: SSH's flow control is per channel, so
    a stream nobody reads stops the other one too."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
