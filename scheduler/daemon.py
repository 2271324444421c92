"""What every daemon shares: its loop, signal handling, systemd notification, the stop event.

Nothing here knows the command line: the click commands live in `scheduler.cli.daemons`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from scheduler import metrics
from scheduler.aio import sleep_or_stop
from scheduler.logging import get_logger
from scheduler.settings import Settings

log = get_logger("daemon")


class Backoff(Protocol):
    """How long a daemon's loop waits after failed ticks (`bus.ReconnectBackoff` is one)."""

    def failed(self) -> float:
        """Count one more failure in a row; the seconds to wait before the next tick."""
        ...

    def reset(self) -> object:
        """A tick made progress: the next failure is the first of a new run."""
        ...


class DoublingBackoff:
    """`interval_s` doubled for each failure in a row, at most `cap` times the interval."""

    def __init__(self, interval_s: float, cap: float = 8.0) -> None:
        self.interval_s = interval_s
        self.cap = cap
        self.failures = 0

    def failed(self) -> float:
        """Count one failure: 2, 4, 8… times the interval, at most `cap` times."""
        self.failures += 1
        return self.interval_s * min(2 ** min(self.failures, 30), self.cap)

    def reset(self) -> None:
        """Back to no failures."""
        self.failures = 0


class NoBackoff:
    """A failed tick waits like any other: the loop's own interval."""

    failures = 0

    def failed(self) -> float:
        """Count one failure; no extra wait."""
        self.failures += 1
        return 0.0

    def reset(self) -> None:
        """Back to no failures."""
        self.failures = 0


Tick = Callable[[], Awaitable[object]]
"""One step of a daemon. It returns False when it had nothing to do (a fetch that timed
out): neither a success that ends a run of failures nor a failure."""


async def run_loop(
    tick: Tick,
    stop: asyncio.Event,
    *,
    interval_s: float = 0.0,
    from_start: bool = False,
    backoff: Backoff | None = None,
    on_error: Callable[[Exception, int], None],
    ready: asyncio.Event | None = None,
) -> None:
    """Call `tick()` until `stop` is set: the one loop every daemon runs.

    Between ticks it waits `interval_s` (counted from the tick's start when `from_start`, so
    that ticks keep a steady rate; else from its end). A tick that raises is reported with
    `on_error(exc, failures in a row)` and never ends the loop; the wait after it is
    `backoff.failed()` (the interval when that is 0). A tick that returns resets the backoff
    unless it returned False. `ready` is set after the first tick, whatever its outcome.
    """
    backoff = backoff or NoBackoff()
    failures = 0
    while not stop.is_set():
        started = time.monotonic()
        wait = 0.0
        try:
            outcome = await tick()
        except Exception as exc:  # noqa: BLE001 - Postgres restarting, NATS down, a bug…
            failures += 1
            on_error(exc, failures)
            wait = backoff.failed()
        else:
            if outcome is not False:
                failures = 0
                backoff.reset()
        if ready is not None:
            ready.set()
        if not wait:
            wait = interval_s - (time.monotonic() - started if from_start else 0.0)
        if wait > 0:
            await sleep_or_stop(stop, wait)


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1", "WATCHDOG=1", "STOPPING=1") to systemd, if it listens."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of systemd's WatchdogSec, the period to send WATCHDOG=1 at; None when unset."""
    usec = os.environ.get("WATCHDOG_USEC")
    return int(usec) / 2_000_000 if usec and usec.isdigit() else None


def install_stop_handlers(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop`, so the daemon finishes its step and drains."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def _notify_systemd(name: str, ready: asyncio.Event, stop: asyncio.Event) -> None:
    """READY=1 once `ready` is set, and WATCHDOG=1 every half WatchdogSec meanwhile.

    The pings come from the daemon's own event loop, so a loop that hangs stops them and
    systemd restarts the daemon.
    """
    interval = watchdog_interval()
    announced = False
    while not stop.is_set():
        if not announced and ready.is_set():
            sd_notify("READY=1")
            log.info("daemon_ready", daemon=name)
            announced = True
        if interval:
            sd_notify("WATCHDOG=1")
        waits = [asyncio.ensure_future(stop.wait())]
        if not announced:
            waits.append(asyncio.ensure_future(ready.wait()))
        try:
            await asyncio.wait(waits, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()


async def serve(
    name: str,
    main: Callable[[asyncio.Event], Awaitable[None]],
    *,
    ready: asyncio.Event | None = None,
    metrics_port: int | None = None,
    database_url: str | None = None,
) -> None:
    """Run `main(stop)` until it returns; SIGTERM/SIGINT set `stop`.

    systemd hears READY=1 when `ready` is set (the daemon sets it once connected; None
    means ready at once), WATCHDOG=1 periodically when WatchdogSec is set, and STOPPING=1
    at the end. With `metrics_port`, Prometheus metrics are served there, and with
    `database_url` too, the state gauges are refreshed from the database.
    """
    stop = asyncio.Event()
    install_stop_handlers(stop)
    log.info("daemon_starting", daemon=name, pid=os.getpid())
    if ready is None:
        ready = asyncio.Event()
        ready.set()
    helpers = [asyncio.create_task(_notify_systemd(name, ready, stop))]
    refresher_db = None
    metrics_server = metrics.start_metrics_server(metrics_port)
    if metrics_server is not None and database_url:
        from scheduler.db import Database

        refresher_db = Database(database_url, pool_size=1)
        helpers.append(asyncio.create_task(metrics.refresh_forever(refresher_db, stop)))
    try:
        await main(stop)
    finally:
        sd_notify("STOPPING=1")
        stop.set()
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        if refresher_db is not None:
            await refresher_db.dispose()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("daemon_stopped", daemon=name)


def run_service(
    name: str,
    settings: Settings,
    metrics_port: int,
    entry: Callable[[asyncio.Event, asyncio.Event], Awaitable[None]],
) -> None:
    """Run a daemon command: `entry(stop, ready)` under `serve` on a new event loop.

    The entry sets `ready` once connected (systemd then hears READY=1) and returns when
    `stop` is set (SIGTERM/SIGINT)."""
    ready = asyncio.Event()

    async def main(stop: asyncio.Event) -> None:
        await entry(stop, ready)

    asyncio.run(
        serve(
            name,
            main,
            ready=ready,
            metrics_port=metrics_port or None,
            database_url=settings.database_url,
        )
    )
