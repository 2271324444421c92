"""The GPU poller: every few seconds, one SSH round trip per VM, all VMs at once.

A sweep is load → probe → apply (docs/invariants.md, invariant 4: no transaction is open during
SSH):
1. one short transaction reads every VM, its GPU rows and its live jobs;
2. every VM runs `poll.poll_command` concurrently (the transport bounds how many);
   the poll also renews the lease of each attempt it probes (the attempt's watchdog
   stops the training when its lease runs out: `remote.watchdog.watchdog_lines`);
3. as results come in, in batches (so writing overlaps the probes still out): finished
   jobs are moved (one short transaction each, GPUs freed in it), then one short
   transaction writes the batch's VM and GPU rows, one array statement per kind of write.
   A poll still out when the sweep's time is up is left running and recorded when it
   lands; a VM silent for `--unreachable-timeout` seconds is marked unreachable meanwhile.

It never frees or steals a GPU a job holds: only a job's end frees its GPUs, and a GPU is
offered only when healthy, unallocated and used by no process (`foreign_busy`). GPUs are
known by UUID: a renumbered GPU keeps its row and its job, and a GPU nvidia-smi no longer
lists is marked unhealthy, never replaced by the card that now has its index
(docs/invariants.md, invariant 8).

What a probed attempt's state means for its job (complete, fail and why, leave it) is
decided without I/O in `scheduler.verdicts`.

The package's modules: `sweep.py` (the sweep: scheduling the probes, loading the VMs,
recording results as they land), `inventory.py` (writing VM status, GPU rows and history
samples), `finish.py` (the live ranks to probe and finishing them), `restarts.py` (a job
group's restarts in place, read by the probe, as events), `state.py` (what a sweep holds).
This module runs the daemon.

Run it as `rlfleet poller` or `python -m scheduler.gpu_poller`.
"""

from __future__ import annotations

import asyncio

from scheduler.daemon import run_loop
from scheduler.db import Database
from scheduler.gpu_poller.sweep import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_UNREACHABLE_AFTER,
    DEFAULT_UNREACHABLE_TIMEOUT_S,
    FLUSH_AFTER_S,
    GpuPoller,
)
from scheduler.history import history_days
from scheduler.liveness import Liveness
from scheduler.logging import get_logger
from scheduler.settings import Settings
from scheduler.transport import Transport, make_transport

__all__ = [
    "DEFAULT_COMMAND_TIMEOUT_S",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_UNREACHABLE_AFTER",
    "DEFAULT_UNREACHABLE_TIMEOUT_S",
    "GpuPoller",
    "run",
    "run_poller",
]

log = get_logger("gpu_poller")


async def run_poller(
    db: Database,
    transport: Transport,
    stop: asyncio.Event,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    unreachable_after: int = DEFAULT_UNREACHABLE_AFTER,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
    unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT_S,
    ready: asyncio.Event | None = None,
    keep_days: float | None = None,
) -> None:
    """Sweep every `interval` seconds until `stop`; a failed sweep is logged, never fatal.
    `keep_days`: the history retention (default: `RLFLEET_HISTORY_DAYS`, else 7 days)."""
    poller = GpuPoller(
        db,
        transport,
        unreachable_after=unreachable_after,
        command_timeout=command_timeout,
        unreachable_timeout=unreachable_timeout,
        history_days=keep_days if keep_days is not None else history_days(),
    )
    log.info(
        "poller_started",
        interval=interval,
        unreachable_after=unreachable_after,
        poll_timeout=command_timeout,
        unreachable_timeout=unreachable_timeout,
    )
    # A sweep waits for the polls at most until the next one is due; the rest land later.
    wait_s = max(interval - FLUSH_AFTER_S, interval / 2)

    async def sweep() -> None:
        await poller.sweep(wait_s=wait_s)

    def failed(exc: Exception, failures: int) -> None:
        # The database may be down: try again next interval.
        log.error("poll_sweep_failed", error=f"{type(exc).__name__}: {exc}")

    try:
        await run_loop(
            sweep, stop, interval_s=interval, from_start=True, on_error=failed, ready=ready
        )
    finally:
        await poller.close()


async def run(
    settings: Settings,
    stop: asyncio.Event,
    ready: asyncio.Event,
    *,
    liveness: Liveness | None = None,
    unreachable_after: int = DEFAULT_UNREACHABLE_AFTER,
) -> None:
    """The poller daemon: sweep until `stop`, `ready` set after the first sweep. The
    knobs default to the environment's (`Liveness.from_env`); `rlfleet poller` and
    `rlfleet up` both run this."""
    knobs = liveness or Liveness.from_env()
    db = Database(settings.database_url, pool_size=2)
    transport = make_transport()
    try:
        await run_poller(
            db,
            transport,
            stop,
            interval=knobs.poll_interval_s,
            unreachable_after=unreachable_after,
            command_timeout=knobs.poll_timeout_s,
            unreachable_timeout=knobs.unreachable_timeout_s,
            ready=ready,
        )
    finally:
        await transport.close()
        await db.dispose()
