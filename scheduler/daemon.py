"""What every daemon shares: signal handling, systemd notification, the stop event."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import click

from scheduler import metrics
from scheduler.logging import configure, get_logger
from scheduler.settings import Settings
from scheduler.validate import check_database_url

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


def daemon_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The connection, metrics and logging flags every daemon command takes.

    They repeat the global `rlfleet` options so `python -m scheduler.<daemon>` (with no
    `rlfleet` group around it) accepts them too; `daemon_settings` resolves them.
    """
    decorators = [
        click.option(
            "--database-url",
            envvar="RLFLEET_DATABASE_URL",
            metavar="URL",
            help="Overrides the global --database-url (env RLFLEET_DATABASE_URL).",
        ),
        click.option(
            "--nats-url",
            envvar="RLFLEET_NATS_URL",
            metavar="URL[,URL…]",
            help="Overrides the global --nats-url (env RLFLEET_NATS_URL).",
        ),
        metrics.metrics_option,
        click.option(
            "--log-level",
            envvar="RLFLEET_LOG_LEVEL",
            default=None,
            type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
            help="Log verbosity (default: the rlfleet --log-level, else INFO).",
        ),
    ]
    for decorate in reversed(decorators):
        fn = decorate(fn)
    return fn


def daemon_settings(
    ctx: click.Context, database_url: str | None, nats_url: str | None, log_level: str | None
) -> Settings:
    """Settings for a daemon command: its own flags, else the `rlfleet` group's, else the
    environment; configures logging on the way."""
    from scheduler.cli._common import CliContext  # here: the CLI package imports daemons

    parent = ctx.find_object(CliContext)  # set when run as `rlfleet <daemon>`
    settings = Settings.load(
        database_url or (parent.settings.database_url if parent else None),
        nats_url or (parent.settings.nats_url if parent else None),
    )
    check_database_url(settings.database_url)  # malformed: exit 2, one line
    configure((log_level or (parent.log_level if parent else None) or "INFO").upper())
    return settings


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
