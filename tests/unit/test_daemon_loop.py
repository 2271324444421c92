"""The one loop every daemon runs (`scheduler.daemon.run_loop`): ticks, the waits between
them, failures and their backoff, `ready` and `stop`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import SimpleNamespace

import pytest

from scheduler import daemon
from scheduler.daemon import DoublingBackoff, run_loop


class Clock:
    """A fake monotonic clock that the ticks advance, and the waits the loop asked for."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()

    async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
        fake.waits.append(round(seconds, 6))
        fake.now += seconds
        return stop.is_set()

    monkeypatch.setattr(daemon, "time", SimpleNamespace(monotonic=fake.monotonic))
    monkeypatch.setattr(daemon, "sleep_or_stop", sleep_or_stop)
    return fake


def scripted(
    clock: Clock, stop: asyncio.Event, steps: Sequence[object], took: float = 0.0
) -> Callable[[], Awaitable[object]]:
    """A tick that plays `steps` in order (an exception is raised, anything else returned),
    each taking `took` seconds of the fake clock; `stop` is set during the last one."""
    script = list(steps)

    async def tick() -> object:
        clock.now += took
        step = script.pop(0)
        if not script:
            stop.set()
        if isinstance(step, Exception):
            raise step
        return step

    return tick


async def test_failures_back_off_and_a_success_resets_the_backoff(clock: Clock) -> None:
    """Given ticks that fail three times, succeed, then fail again, the waits double after
    each failure in a row (capped) and start over after the success; every failure is
    reported with its count in a row."""
    stop = asyncio.Event()
    errors: list[tuple[str, int]] = []
    steps = [OSError("a"), OSError("b"), OSError("c"), OSError("d"), "ok", OSError("e"), "ok"]
    await run_loop(
        scripted(clock, stop, steps),
        stop,
        interval_s=1.0,
        backoff=DoublingBackoff(1.0, cap=8.0),
        on_error=lambda exc, n: errors.append((str(exc), n)),
    )
    assert errors == [("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 1)]
    assert clock.waits == [2.0, 4.0, 8.0, 8.0, 1.0, 2.0, 1.0]


async def test_a_steady_rate_counts_the_interval_from_the_tick_start(clock: Clock) -> None:
    """Given `from_start`, a tick that takes 0.3 s of a 1 s interval waits 0.7 s, and one
    that overruns the interval starts the next tick at once; a failed tick waits the same
    without a backoff."""
    stop = asyncio.Event()
    await run_loop(
        scripted(clock, stop, [None, RuntimeError("db down"), None], took=0.3),
        stop,
        interval_s=1.0,
        from_start=True,
        on_error=lambda exc, n: None,
    )
    assert clock.waits == [0.7, 0.7, 0.7]

    clock.waits.clear()
    stop.clear()
    await run_loop(
        scripted(clock, stop, [None, None], took=1.5),
        stop,
        interval_s=1.0,
        from_start=True,
        on_error=lambda exc, n: None,
    )
    assert clock.waits == []


async def test_a_tick_with_nothing_to_do_keeps_the_run_of_failures(clock: Clock) -> None:
    """Given a failure, a tick that returns False (a fetch that timed out) and another
    failure, the second failure is the second in a row: False is no success."""
    stop = asyncio.Event()
    errors: list[int] = []
    await run_loop(
        scripted(clock, stop, [OSError(), False, OSError(), True]),
        stop,
        backoff=DoublingBackoff(0.5),
        on_error=lambda exc, n: errors.append(n),
    )
    assert errors == [1, 2]
    assert clock.waits == [1.0, 2.0]


async def test_ready_after_the_first_tick_even_a_failed_one_and_stop_ends_it() -> None:
    """Given a tick that always fails, `ready` is set after the first one, and setting
    `stop` ends the loop during its wait."""
    stop, ready = asyncio.Event(), asyncio.Event()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        raise RuntimeError("never works")

    loop = asyncio.create_task(
        run_loop(tick, stop, interval_s=3600, ready=ready, on_error=lambda exc, n: None)
    )
    await asyncio.wait_for(ready.wait(), 10)
    stop.set()
    await asyncio.wait_for(loop, 10)
    assert ticks == 1
