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


async def serve(name: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until it returns; signals set `stop`. Notifies systemd around it."""
    stop = asyncio.Event()
    install_stop_handlers(stop)
    log.info("daemon_starting", daemon=name, pid=os.getpid())
    await main(stop)
    sd_notify("STOPPING=1")
    log.info("daemon_stopped", daemon=name)
