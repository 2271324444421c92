"""What every daemon shares: signal handling, systemd notification, the stop event."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable

from scheduler.logging import get_logger

log = get_logger("daemon")


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
    from scheduler import metrics  # here: metrics imports the models, daemon.py stays light

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
