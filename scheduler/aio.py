"""Small asyncio helpers the daemons share."""

from __future__ import annotations

import asyncio
import contextlib


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, or less if `stop` is set meanwhile; returns whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()
