"""The dispatcher daemon: pull job ids from `jobs.new`, claim GPUs, launch over SSH.

Every dispatcher binds to the one durable pull consumer, so a message goes to one of them
at a time; Postgres decides the rest. Messages are fetched in batches, and each batch is
handled while the next one is fetched: claim all its jobs (one short transaction:
`claims.batch.claim_batch`; jobs that fit nowhere go `pending` in it) → launch the claimed
ones concurrently (SSH, no transaction) → record all the pids (one guarded statement:
`claims.records.mark_running_batch`) → ack. A process runs one claim transaction at a time
(its batches would only contend for the same best-fit GPUs) and one running record at a time;
the batches that arrive meanwhile are claimed, or recorded, together in the next one
(`records.WriteBatcher`), so transactions stay large even when messages trickle in one by
one. Launches overlap freely.

A message is acked only once the database says `running`, `pending` or `failed` (or the
job needs nothing from us); transient trouble with the database is a nak with a delay, and
a claim whose launch never got recorded is taken back by its lease
(`claims.leases.expire_leases`).

The package's modules: `consumer.py` (the NATS pull subscription, acks and naks, batches),
`launch.py` (one launch loop over a claimed attempt's nodes, whatever the job's shape),
`records.py` (what is written after a launch, and the batched writes); this module
composes them with the claim orchestration (`GlobalJobDispatcher`) and runs the daemon.

Run it as `rlfleet dispatcher` or `python -m scheduler.dispatcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from collections.abc import Sequence
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from scheduler import bus
from scheduler.aio import sleep_or_stop
from scheduler.claims.batch import DEFAULT_LEASE_S, claim_batch
from scheduler.claims.result import Claim, NoClaim
from scheduler.db import Database, is_unavailable
from scheduler.gpus import refresh_available
from scheduler.liveness import Liveness
from scheduler.logging import get_logger
from scheduler.remote.launch import LaunchResult
from scheduler.remote.watchdog import DEFAULT_FENCE_AFTER_S, DEFAULT_FENCE_GRACE_S
from scheduler.settings import Settings
from scheduler.states import JobStatus
from scheduler.transport import Transport, make_transport

from .consumer import Consumer, DispatchStats, Replies, TransientError, db_error
from .launch import Launcher, Targets
from .records import Launch, Records, WriteBatcher

log = get_logger("dispatcher")

CONTENDED_RETRIES = 20
LEASE_MARGIN_S = 2.0


def default_actor() -> str:
    """`dispatcher:<host>:<pid>`, cut to fit `job_events.actor`."""
    return f"dispatcher:{socket.gethostname()}:{os.getpid()}"[:64]


class GlobalJobDispatcher:
    """Consumes `jobs.new` and turns queued jobs into running ones: the consumer hands each
    fetched batch to `dispatch_batch`, which claims, launches (`Launcher`) and records
    (`Records`)."""

    def __init__(
        self,
        db: Database,
        js: JetStreamContext,
        transport: Transport,
        *,
        actor: str | None = None,
        batch: int = 32,
        max_in_flight: int = 64,
        lease_s: float = DEFAULT_LEASE_S,
        launch_timeout_s: float = 30.0,
        kill_grace_s: float = 10.0,
        fetch_timeout_s: float = 1.0,
        fence_after_s: float = DEFAULT_FENCE_AFTER_S,
        fence_grace_s: float = DEFAULT_FENCE_GRACE_S,
    ) -> None:
        self.db = db
        self.js = js
        self.transport = transport
        self.actor = actor or default_actor()
        self.max_in_flight = max_in_flight
        self.lease_s = lease_s
        self.launch_timeout_s = launch_timeout_s
        self.stats = DispatchStats()
        self.consumer = Consumer(
            js,
            self.dispatch_batch,
            self.stats,
            batch=batch,
            max_in_flight=max_in_flight,
            fetch_timeout_s=fetch_timeout_s,
        )
        self.targets = Targets(db)
        self.launcher = Launcher(
            db,
            transport,
            self.targets,
            launch_timeout_s=launch_timeout_s,
            fence_after_s=fence_after_s,
            fence_grace_s=fence_grace_s,
        )
        self.records = Records(
            db, transport, self.stats, actor=self.actor, kill_grace_s=kill_grace_s, most=4 * batch
        )
        self._touched_vms: set[int] = set()
        self._claims = WriteBatcher(self._claim_batch, most=4 * batch)

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Fetch and handle messages until `stop` is set, then finish the ones in flight.

        `ready` is set once bound to the consumer."""
        if not await self.consumer.subscribe(stop):
            return
        # systemd's READY=1 and watchdog pings come from `serve`, driven by `ready`.
        if ready is not None:
            ready.set()
        log.info("dispatcher_ready", actor=self.actor, max_in_flight=self.max_in_flight)
        counter = asyncio.create_task(self._refresh_counts(stop))
        await self.consumer.consume(stop)
        await self.consumer.drain(self.launch_timeout_s + 5)
        counter.cancel()
        with contextlib.suppress(BaseException):
            await counter
        await self._flush_counts()
        await self.consumer.close()

    async def _refresh_counts(self, stop: asyncio.Event) -> None:
        """Recount `vms.available_gpus` of the VMs claimed on, at most twice a second."""
        while not stop.is_set():
            await sleep_or_stop(stop, 0.5)
            await self._flush_counts()

    async def _flush_counts(self) -> None:
        if not self._touched_vms:
            return
        vm_ids, self._touched_vms = self._touched_vms, set()
        try:
            await refresh_available(self.db, vm_ids)
        except Exception as exc:  # noqa: BLE001 - a count for display; the poller redoes it
            log.warning("count_refresh_failed", error=str(exc) or type(exc).__name__)

    async def dispatch_batch(self, jobs: Sequence[tuple[Msg, int]], replies: Replies) -> None:
        """Claim every job in one transaction → launch the claimed ones concurrently (no
        transaction) → record the launched ones `running` in one statement."""
        results = await self._claim_all([job_id for _msg, job_id in jobs])
        claimed: list[tuple[Msg, Claim]] = []
        for (msg, job_id), result in zip(jobs, results, strict=True):
            if isinstance(result, Claim):
                self._touched_vms.add(result.vm_id)
                claimed.append((msg, result))
            elif isinstance(result, TransientError):
                await replies.defer(msg, job_id, result)
            else:
                await replies.reply(msg, self._not_claimed(result))
        if claimed:
            await self._launch_all(claimed, replies)

    async def _claim_all(self, job_ids: list[int]) -> list[Claim | NoClaim | TransientError]:
        """One result per job id: the batch claim, retried for the jobs whose free GPUs
        other claimers held locked (their commit is a few milliseconds away)."""
        results: list[Claim | NoClaim | TransientError | None] = [None] * len(job_ids)
        todo = list(range(len(job_ids)))
        for attempt in range(CONTENDED_RETRIES):
            if attempt:
                await asyncio.sleep(0.005 + random.random() * 0.02)
            try:
                # One claim transaction at a time per process (this dispatcher's batches
                # would otherwise contend for the same best-fit GPU rows), and the batches
                # that wait meanwhile are claimed together in the next one.
                batch = await self._claims.submit([job_ids[i] for i in todo])
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                # Nothing of this round was committed; earlier rounds' claims stand.
                for i in todo:
                    results[i] = TransientError(db_error(exc))
                todo = []
                break
            retry: list[int] = []
            for i, result in zip(todo, batch, strict=True):
                if isinstance(result, NoClaim) and result.contended:
                    retry.append(i)
                elif isinstance(result, NoClaim) and result.waiting:
                    # Redelivered a little later (nak with delay): the kill takes a tick.
                    results[i] = TransientError(result.reason or "waiting")
                else:
                    results[i] = result
            todo = retry
            self.stats.contended += len(retry)
            if not todo:
                break
        for i in todo:
            results[i] = TransientError("free GPUs stayed locked by other claimers")
        return [r for r in results if r is not None]

    async def _claim_batch(self, job_ids: list[int]) -> list[Claim | NoClaim]:
        return await claim_batch(self.db, job_ids, actor=self.actor, lease_s=self.lease_s)

    def _not_claimed(self, result: NoClaim) -> str:
        """Count and log a job that claimed nothing; returns the outcome for metrics."""
        if result.status == JobStatus.PENDING and result.moved_to_pending:
            self.stats.pending += 1
            log.info("job_pending", job_id=result.job_id, reason=result.reason)
            return "pending"
        if result.rejected:  # a row the launch cannot use: failed with config_error
            self.stats.rejected += 1
            return "failed"
        self.stats.skipped += 1
        log.info("job_skipped", job_id=result.job_id, status=result.status, reason=result.reason)
        return "skipped"

    async def _launch_all(self, claimed: list[tuple[Msg, Claim]], replies: Replies) -> None:
        """Launch every claim concurrently, then settle failures and record the rest."""
        try:
            targets = [await self.targets.get(claim.vm_id) for _msg, claim in claimed]
        except TransientError as exc:
            for msg, claim in claimed:  # the leases bring the claims back
                await replies.defer(msg, claim.job_id, exc)
            return
        outcomes = await asyncio.gather(
            *(
                self.launcher.launch(claim, target)
                for (_msg, claim), target in zip(claimed, targets, strict=True)
            )
        )
        launched: list[Launch] = []
        failed = []
        for (msg, claim), target, outcome in zip(claimed, targets, outcomes, strict=True):
            if isinstance(outcome, LaunchResult):
                launched.append(Launch(msg, claim, target, outcome.pid, outcome.path))
            else:
                failed.append(self.records.fail(replies, msg, claim, target, outcome))
        await asyncio.gather(*failed)
        if launched:
            await self.records.record_running(launched, replies)


async def run_dispatcher(
    settings: Settings,
    stop: asyncio.Event,
    *,
    ready: asyncio.Event | None = None,
    transport: Transport | None = None,
    **options: Any,
) -> None:
    """Connect to Postgres and NATS and dispatch until `stop`."""
    nc = await bus.connect_until(settings, name="rlfleet-dispatcher", stop=stop)
    if nc is None:
        return
    db = Database(settings.database_url, pool_size=10)
    own_transport = transport is None
    transport = transport or make_transport()
    try:
        await GlobalJobDispatcher(db, nc.jetstream(), transport, **options).run(stop, ready)
    finally:
        await nc.close()
        if own_transport:
            await transport.close()
        await db.dispose()


async def run(
    settings: Settings, stop: asyncio.Event, ready: asyncio.Event, **options: Any
) -> None:
    """The dispatcher daemon: dispatch until `stop`, `ready` set once subscribed.
    `options` are `GlobalJobDispatcher`'s knobs; the fence knobs default to the
    environment's (`Liveness.from_env`). `rlfleet dispatcher` and `rlfleet up` run this."""
    knobs = Liveness.from_env()
    options.setdefault("fence_after_s", knobs.fence_after_s)
    options.setdefault("fence_grace_s", knobs.fence_grace_s)
    await run_dispatcher(settings, stop, ready=ready, **options)
