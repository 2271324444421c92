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

Several pollers (on any hosts) divide the VMs between them, Postgres the only coordinator:
each polls only the VMs it holds under its lease (`shares.py`), renewed four times per
lease from a thread of its own; VMs it takes (added, released by another, or left by a
poller that died) are polled at once, between its sweeps.

The package's modules: `sweep.py` (the sweep: scheduling the probes, loading the VMs,
recording results as they land), `inventory.py` (writing VM status, GPU rows and history
samples), `finish.py` (the live ranks to probe and finishing them), `restarts.py` (a job
group's restarts in place, read by the probe, as events), `state.py` (what a sweep holds),
`shares.py` (the poller lease and the VMs it holds). This module runs the daemon.

Run it as `rlfleet poller` or `python -m scheduler.gpu_poller`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from scheduler import metrics
from scheduler.db import Database
from scheduler.gpu_poller.shares import Keeper, Renewal, Shares
from scheduler.gpu_poller.sweep import (
    DEFAULT_COMMAND_TIMEOUT_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_UNREACHABLE_AFTER,
    DEFAULT_UNREACHABLE_TIMEOUT_S,
    FLUSH_AFTER_S,
    GpuPoller,
)
from scheduler.history import GPU_SAMPLE_EVERY_S, history_days
from scheduler.liveness import Liveness, SSHDeadlines
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
    lease_s: float = 0.0,
    name: str | None = None,
) -> None:
    """Sweep this poller's share of the VMs every `interval` seconds until `stop`; a failed
    sweep or renewal is logged, never fatal. `keep_days`: the history retention (default:
    `RLFLEET_HISTORY_DAYS`, else 7 days). `lease_s`: the poller lease (0: derived from the
    interval and the unreachable timeout, `Liveness.poller_lease`); `name`: this poller's
    name in `pollers` (default `host:pid`)."""
    knobs = Liveness(
        poll_interval_s=interval,
        unreachable_timeout_s=unreachable_timeout,
        poller_lease_s=lease_s,
    )
    shares = Shares(db, lease_s=knobs.poller_lease(), name=name)  # its db: the keeper's
    poller = GpuPoller(
        db,
        transport,
        unreachable_after=unreachable_after,
        command_timeout=command_timeout,
        unreachable_timeout=unreachable_timeout,
        history_days=keep_days if keep_days is not None else history_days(),
        shares=shares,
        gpu_sample_every_s=GPU_SAMPLE_EVERY_S,
    )
    log.info(
        "poller_started",
        poller=shares.name,
        interval=interval,
        unreachable_after=unreachable_after,
        poll_timeout=command_timeout,
        unreachable_timeout=unreachable_timeout,
        lease=shares.lease_s,
    )
    # A sweep waits for the polls at most until the next one is due; the rest land later.
    wait_s = max(interval - FLUSH_AFTER_S, interval / 2)
    taken: set[int] = set()
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    def took(vms: frozenset[int]) -> None:  # in the loop, from the keeper's thread
        taken.update(vms)
        wake.set()

    def renewed(renewal: Renewal) -> None:  # in the keeper's thread
        metrics.set_poller_held(len(renewal.held), renewal.pollers)
        metrics.count_takeovers(len(renewal.reaped))
        if renewal.taken:
            loop.call_soon_threadsafe(took, renewal.taken)

    keeper = Keeper(shares, db.url, renewed)
    keeper.start()
    try:
        # The first sweep waits for the first renewal (held VMs), at most one lease.
        await asyncio.to_thread(keeper.tried.wait, shares.lease_s)
        next_due = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_due:
                next_due = now + interval
                # A full sweep polls every held VM, those just taken included.
                wake.clear()
                taken.clear()
                await _sweep(poller, wait_s=wait_s)
                if ready is not None:
                    ready.set()
            elif wake.is_set():
                wake.clear()
                only = set(taken)
                taken.clear()
                await _sweep(poller, wait_s=max(0.1, min(wait_s, next_due - now)), only=only)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first_of(wake, stop), next_due - now)
    finally:
        await poller.close()
        # Stops renewing and gives the VMs back, so the others take them at once.
        await asyncio.to_thread(keeper.stop)


async def _sweep(poller: GpuPoller, *, wait_s: float, only: set[int] | None = None) -> None:
    try:
        await poller.sweep(wait_s=wait_s, only=only)
    except Exception as exc:  # noqa: BLE001 - the database may be down: try again next time
        log.error("poll_sweep_failed", error=f"{type(exc).__name__}: {exc}")


async def _first_of(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


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
    # No keepalives between polls: each poll is one, with a deadline.
    keepalive = max(knobs.poll_keepalive_s(), SSHDeadlines.from_env().keepalive_interval_s)
    transport = make_transport(keepalive_interval=keepalive)
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
            lease_s=knobs.poller_lease(),
        )
    finally:
        await transport.close()
        await db.dispose()
