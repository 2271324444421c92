"""The requeue manager: nothing submitted is lost, nothing runs twice (docs/invariants.md,
invariants 2 and 3).

`rlfleet requeue` / `python -m scheduler.requeue`. Every `--interval` seconds one tick:

1. **Expired claims** — `starting` jobs past their lease go back to `queued`, GPUs freed
   (`scheduler.claims.leases.expire_leases`, which records the attempt as a leftover).
2. **Lost nodes** — `running`/`starting` jobs on a VM the poller has found unreachable,
   and that has not answered for longer than `--node-lost-timeout` (counted from its last
   answer), fail with `node_lost`; their attempts are recorded as leftovers and their
   GPUs freed in the books (`attempts.finish.end_attempt`). A shorter blip restarts
   nothing. The timeout exceeds the attempts' fence (`--fence-after` + grace), so the
   attempt has stopped itself by then even if the VM never answers again.
3. **Decisions** — a failed job that has no decision yet (`retry_decision` NULL) gets
   one from `scheduler.retry.decide`: `retry` at `next_attempt_at`, or `give_up` with a
   status_reason "gave up …" that stays. The policy's cap on machine faults reads the
   job's `machine_faults`, which `jobs.transition` counts.
4. **Retries** — failed jobs decided `retry` whose `next_attempt_at` has come go back to
   `queued` (`retry_count + 1`, except after a machine fault — `node_lost`,
   `vm_removed`, or `launch_failed` with exit 126/127 — which does not count).
5. **Pending jobs** — put back in the queue when the fleet reports free GPUs that fit
   them, in priority then submission order, or after `--pending-timeout` anyway.
   Anti-starvation (honest and simple): once a job that does not fit now, but fits on
   some VM, has waited `--starvation-after` seconds, the pending jobs behind it (equal or
   lower priority, submitted later) are not re-announced until it runs, so the GPUs that
   jobs finishing meanwhile free up accumulate for it. The dispatcher places greedily and fresh
   submissions still go straight to it; this rule only governs what the requeue manager
   announces again.
6. **Leftovers** — for each leftover not yet killed whose VM answers SSH, the attempt's
   process group is killed (TERM, then KILL) over SSH; only then is its row closed, and
   the claim query offers the GPUs again (it skips GPUs an open row lists): the sweep of
   `scheduler.leftovers.LeftoverSweep`. A VM marked `removing` by `vm remove --force` is
   deleted once none of its rows is open (and its jobs are failed as `vm_removed`, should
   one have reached it). An attempt its watchdog had fenced gets an event saying so.
7. **Announcements** — every queued job whose current queued spell was never announced
   (`published_at` NULL or older than `queued_at`: a row inserted straight into the
   database, a publish lost while NATS was down, any of the moves above) is published on
   `jobs.new`, and so is one announced more than `--republish-after` seconds ago and still
   queued. A job whose previous attempt is a leftover on a VM that answers waits until
   step 6 killed it, so a job never runs twice; a leftover on a lost VM cannot be waited
   for, and is killed when the VM answers again. The `Nats-Msg-Id` is built from the
   job, its attempt and the previous `published_at`, so two managers publishing the same
   state are deduplicated by JetStream; `published_at` is set only after the stream
   stored the message.

Steps 2 to 5's database work, and the choice of what step 7 announces, is one short
transaction under a Postgres advisory transaction lock, so several copies can run at once
(one does the work, the others skip the tick); every SSH and NATS call happens after it
committed (docs/invariants.md, invariant 4).

Each step is a function of its own, composed by `RequeueManager.tick`: step 1 is
`scheduler.claims.leases.expire_leases`, step 2 `requeue_steps.lost_nodes`, steps 3 and 4
`requeue_steps.retries`, step 5 `requeue_steps.wake_pending` (the choice itself is the pure
`scheduler.pending.plan_pending`), step 6 `scheduler.leftovers.LeftoverSweep` and step 7
`requeue_steps.announce`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from dataclasses import dataclass, field

from sqlalchemy import func, select

from scheduler import bus, metrics
from scheduler.claims.leases import expire_leases
from scheduler.daemon import DoublingBackoff, run_loop
from scheduler.db import Database
from scheduler.fleet import delete_removed_vms
from scheduler.leftovers import LeftoverSweep
from scheduler.liveness import Liveness
from scheduler.logging import get_logger
from scheduler.requeue_steps import BATCH
from scheduler.requeue_steps.announce import (
    Announce,
    NatsPublisher,
    Publisher,
    announce,
    announce_msg_id,
    to_announce,
)
from scheduler.requeue_steps.lost_nodes import NODE_LOST, fail_lost_nodes
from scheduler.requeue_steps.retries import decide_failed, requeue_due
from scheduler.requeue_steps.wake_pending import wake_pending
from scheduler.retry import DEFAULT_POLICY, RetryPolicy
from scheduler.settings import Settings, redact_url
from scheduler.transport import Transport

__all__ = [
    "BATCH",
    "NODE_LOST",
    "NatsPublisher",
    "Publisher",
    "RequeueConfig",
    "RequeueManager",
    "TickReport",
    "announce_msg_id",
    "run",
    "run_daemon",
]

log = get_logger("requeue")

ADVISORY_LOCK_KEY = 0x726C666C_7271  # "rlfl" "rq": one requeue tick at a time per database


@dataclass(frozen=True)
class RequeueConfig:
    """The requeue manager's knobs; the defaults suit a real fleet."""

    interval_s: float = 2.0
    pending_timeout_s: float = 60.0
    node_lost_timeout_s: float = Liveness.node_lost_timeout_s
    republish_after_s: float = 60.0
    """A queued job announced this long ago and still queued is announced again."""
    recheck_after_s: float = 2.0
    """A pending job is not re-announced within this long of a dispatcher's last look."""
    starvation_after_s: float = 300.0
    kill_grace_s: float = 10.0
    policy: RetryPolicy = DEFAULT_POLICY


@dataclass
class TickReport:
    """What one tick did, for logs and tests."""

    skipped: bool = False
    expired: list[int] = field(default_factory=list)
    node_lost: list[int] = field(default_factory=list)
    gave_up: list[int] = field(default_factory=list)
    scheduled: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    unpended: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)
    publish_failed: int = 0
    killed: list[int] = field(default_factory=list)
    kill_failed: int = 0
    removed_vms: list[str] = field(default_factory=list)

    def busy(self) -> bool:
        """Whether the tick changed anything."""
        return any(
            (
                self.expired,
                self.node_lost,
                self.gave_up,
                self.scheduled,
                self.retried,
                self.unpended,
                self.published,
                self.killed,
                self.removed_vms,
            )
        )


class RequeueManager:
    """One requeue manager: `tick()` does one pass; `run(stop)` ticks until stopped."""

    def __init__(
        self,
        db: Database,
        publisher: Publisher | None,
        transport: Transport | None,
        config: RequeueConfig | None = None,
        *,
        rng: random.Random | None = None,
        actor: str | None = None,
    ) -> None:
        self.db = db
        self.publisher = publisher
        self.transport = transport
        self.config = config or RequeueConfig()
        self.rng = rng or random.Random()
        self.actor = actor or f"requeue:{socket.gethostname()}:{os.getpid()}"

    # -- the tick -------------------------------------------------------------------------

    async def tick(self) -> TickReport:
        """One pass: recover, decide, retry, wake pending jobs, kill leftovers, announce."""
        cfg = self.config
        report = TickReport()
        report.expired = await expire_leases(self.db, actor=self.actor)
        for _ in report.expired:
            metrics.count_recovery("lease_expired")
        chosen: list[Announce] = []
        async with self.db.transaction() as session:
            got = await session.scalar(select(func.pg_try_advisory_xact_lock(ADVISORY_LOCK_KEY)))
            if not got:
                report.skipped = True
            else:
                now = await session.scalar(select(func.now()))
                assert now is not None
                report.removed_vms = await delete_removed_vms(session, actor=self.actor)
                report.node_lost = await fail_lost_nodes(
                    session, timeout_s=cfg.node_lost_timeout_s, actor=self.actor
                )
                report.scheduled, report.gave_up = await decide_failed(
                    session, now, rng=self.rng, policy=cfg.policy
                )
                report.retried = await requeue_due(session, actor=self.actor)
                report.unpended = await wake_pending(
                    session,
                    recheck_after_s=cfg.recheck_after_s,
                    pending_timeout_s=cfg.pending_timeout_s,
                    starvation_after_s=cfg.starvation_after_s,
                    actor=self.actor,
                )
                chosen = await to_announce(session, republish_after_s=cfg.republish_after_s)
        if not report.skipped and self.transport is not None:
            # The manager that holds the lock this tick does the kills.
            swept = await LeftoverSweep(
                self.db, self.transport, grace_s=cfg.kill_grace_s, actor=self.actor
            ).sweep()
            report.killed, report.kill_failed = swept.killed, swept.kill_failed
        if chosen and self.publisher is not None:
            announced = await announce(self.db, self.publisher, chosen)
            report.published, report.publish_failed = announced.published, announced.failed
        return report

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every `interval` until `stop` is set; a failed tick is logged, not fatal,
        and failures in a row space the ticks out (2, 4, at most 8 intervals)."""

        async def tick() -> None:
            report = await self.tick()
            if report.busy():
                log.info(
                    "requeue_tick",
                    expired=len(report.expired),
                    node_lost=len(report.node_lost),
                    scheduled=len(report.scheduled),
                    gave_up=len(report.gave_up),
                    retried=len(report.retried),
                    unpended=len(report.unpended),
                    published=len(report.published),
                    killed=len(report.killed),
                    removed_vms=report.removed_vms,
                )

        def failed(exc: Exception, failures: int) -> None:
            # Postgres restarting, a bug in one row…: logged, and the next tick tries again.
            log.warning(
                "requeue_tick_failed",
                error=(str(exc).splitlines() or [type(exc).__name__])[0][:300],
                error_type=type(exc).__name__,
                failures=failures,
            )

        interval = self.config.interval_s
        await run_loop(
            tick, stop, interval_s=interval, backoff=DoublingBackoff(interval), on_error=failed
        )


# -- the daemon ---------------------------------------------------------------------------


async def run_daemon(
    settings: Settings,
    config: RequeueConfig,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
) -> None:
    """The requeue manager as a daemon: connect, tick until stopped, clean up.
    `ready` is set once connected (systemd's READY=1 waits for it)."""
    from scheduler.transport import make_transport

    db = Database(settings.database_url, pool_size=3)
    transport = make_transport()
    nc = await bus.connect_until(settings, name="rlfleet-requeue", stop=stop)
    try:
        if nc is not None:
            manager = RequeueManager(db, NatsPublisher(nc), transport, config)
            if ready is not None:
                ready.set()
            log.info(
                "requeue_started",
                database=redact_url(settings.database_url),
                nats=redact_url(settings.nats_url),
                interval_s=config.interval_s,
                node_lost_timeout_s=config.node_lost_timeout_s,
                pending_timeout_s=config.pending_timeout_s,
            )
            await manager.run(stop)
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        await transport.close()
        await db.dispose()


async def run(
    settings: Settings,
    stop: asyncio.Event,
    ready: asyncio.Event,
    config: RequeueConfig | None = None,
) -> None:
    """The requeue manager daemon until `stop`, `ready` set once connected. Without a
    `config`, the default knobs (the node-lost timeout from RLFLEET_NODE_LOST_TIMEOUT when
    set). `rlfleet requeue` and `rlfleet up` run this."""
    config = config or RequeueConfig(node_lost_timeout_s=Liveness.from_env().node_lost_timeout_s)
    await run_daemon(settings, config, stop, ready)
