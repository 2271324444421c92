"""The requeue manager: nothing submitted is lost, nothing runs twice (docs/invariants.md,
invariants 2 and 3).

`rlfleet requeue` / `python -m scheduler.requeue`. Every `--interval` seconds one tick:

1. **Expired claims** — `starting` jobs past their lease go back to `queued`, GPUs freed
   (`scheduler.claims.expire_leases`, which records the attempt as a leftover).
2. **Lost nodes** — `running`/`starting` jobs on a VM the poller has found unreachable,
   and that has not answered for longer than `--node-lost-timeout` (counted from its last
   answer), fail with `node_lost`; their attempts are recorded as leftovers and their
   GPUs freed in the books (`leftovers.abandon_attempt`). A shorter blip restarts
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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import bus, metrics
from scheduler.claims import LARGEST_VM_SQL, expire_leases
from scheduler.daemon import DoublingBackoff, run_loop
from scheduler.db import Database
from scheduler.fleet import delete_removed_vms
from scheduler.gpus import FREE_BY_VM_SQL
from scheduler.jobs import transition
from scheduler.leftovers import AttemptRecord, LeftoverSweep, abandon_attempt, leftover_may_run
from scheduler.liveness import Liveness
from scheduler.logging import get_logger
from scheduler.models import VM, Job
from scheduler.retry import (
    DEFAULT_POLICY,
    Failure,
    GiveUp,
    PendingJob,
    RetryPolicy,
    counts_against_limit,
    decide,
    is_machine_fault,
    plan_pending,
)
from scheduler.settings import Settings, redact_url
from scheduler.states import FailureReason, JobStatus, RetryDecision, VMStatus
from scheduler.transport import Transport

log = get_logger("requeue")

ADVISORY_LOCK_KEY = 0x726C666C_7271  # "rlfl" "rq": one requeue tick at a time per database
NODE_LOST = FailureReason.NODE_LOST.value
BATCH = 500
FENCED_READ_TIMEOUT_S = 10.0
"""Most jobs handled per step per tick; the rest wait for the next tick."""


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


class Publisher(Protocol):
    """Announces a job id on `jobs.new`."""

    async def publish(self, job_id: int, msg_id: str) -> None:
        """Publish and wait until the stream stored it; raise on any failure."""
        ...


class NatsPublisher:
    """Publishes through JetStream, so the stream deduplicates on `Nats-Msg-Id`."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._stream_ready = False

    async def publish(self, job_id: int, msg_id: str) -> None:
        """Publish `job_id` with `msg_id`; the stream is (re)created first if needed."""
        if not self.nc.is_connected:
            raise ConnectionError("not connected to NATS")
        if not self._stream_ready:
            await bus.ensure_stream(self.js)
            self._stream_ready = True
        await bus.publish_job(self.js, job_id, dedupe_id=msg_id)


@dataclass(frozen=True)
class _Announce:
    job_id: int
    attempt: int
    queued_at: datetime | None
    published_at: datetime | None


def announce_msg_id(job_id: int, attempt: int, published_at: datetime | None) -> str:
    """The `Nats-Msg-Id` for announcing a job again: same state, same id."""
    generation = 0 if published_at is None else int(published_at.timestamp() * 1000)
    return bus.msg_id(job_id, attempt, generation)


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
        """One pass: recover, decide, retry, wake pending jobs, announce, kill leftovers."""
        report = TickReport()
        report.expired = await expire_leases(self.db, actor=self.actor)
        for _ in report.expired:
            metrics.count_recovery("lease_expired")
        announce: list[_Announce] = []
        async with self.db.transaction() as session:
            got = await session.scalar(select(func.pg_try_advisory_xact_lock(ADVISORY_LOCK_KEY)))
            if not got:
                report.skipped = True
            else:
                now = await session.scalar(select(func.now()))
                assert now is not None
                report.removed_vms = await delete_removed_vms(session, actor=self.actor)
                report.node_lost = await self._fail_lost_nodes(session)
                report.scheduled, report.gave_up = await self._decide_failed(session, now)
                report.retried = await self._requeue_due(session)
                report.unpended = await self._wake_pending(session)
                announce = await self._to_announce(session)
        if not report.skipped and self.transport is not None:
            # The manager that holds the lock this tick does the kills.
            swept = await LeftoverSweep(
                self.db, self.transport, grace_s=self.config.kill_grace_s, actor=self.actor
            ).sweep()
            report.killed, report.kill_failed = swept.killed, swept.kill_failed
        if announce:
            await self._announce(announce, report)
        return report

    async def _fail_lost_nodes(self, session: AsyncSession) -> list[int]:
        """Fail live jobs of VMs unreachable for longer than the node-lost timeout."""
        timeout = self.config.node_lost_timeout_s
        outage = func.extract("epoch", func.now() - VM.unreachable_since)
        rows = (
            await session.execute(
                select(*AttemptRecord.columns(), Job.status, VM.name, outage.label("outage_s"))
                .join(VM, VM.id == Job.vm_id)
                .where(
                    Job.status.in_([JobStatus.RUNNING.value, JobStatus.STARTING.value]),
                    VM.status == VMStatus.UNREACHABLE.value,
                    VM.unreachable_since < func.now() - timedelta(seconds=timeout),
                )
                .order_by(Job.id)
                .limit(BATCH)
                .with_for_update(of=Job, skip_locked=True)
            )
        ).all()
        lost: list[int] = []
        for row in rows:
            why = f"{NODE_LOST}: VM {row.name} unreachable for {float(row.outage_s):.0f}s"
            # The process may live on when the VM comes back: it is recorded as a leftover,
            # to be killed then, and its GPUs stay out of every claim until that is done.
            moved = await abandon_attempt(
                session,
                AttemptRecord.from_row(row),
                expected=JobStatus(row.status),
                to=JobStatus.FAILED,
                reason=why,
                actor=self.actor,
                leftover=NODE_LOST,
                failure_reason=NODE_LOST,
            )
            if not moved:
                continue
            lost.append(row.id)
            metrics.count_failure(NODE_LOST)
            metrics.count_recovery(NODE_LOST)
            log.warning(
                "node_lost",
                job_id=row.id,
                vm=row.name,
                attempt=row.attempt,
                outage_s=round(float(row.outage_s), 1),
            )
        return lost

    async def _decide_failed(
        self, session: AsyncSession, now: datetime
    ) -> tuple[list[int], list[int]]:
        """Stamp the retry decision on failed jobs that have none yet."""
        rows = (
            await session.execute(
                select(
                    Job.id,
                    Job.attempt,
                    Job.retry_count,
                    Job.max_retries,
                    Job.failure_reason,
                    Job.exit_code,
                    Job.machine_faults,
                )
                .where(Job.status == JobStatus.FAILED.value, _UNDECIDED)
                .order_by(Job.id)
                .limit(BATCH)
                .with_for_update(of=Job, skip_locked=True)
            )
        ).all()
        scheduled: list[int] = []
        gave_up: list[int] = []
        for row in rows:
            failure = Failure(row.failure_reason, row.exit_code, row.machine_faults)
            decision = decide(row, failure, now, self.rng, self.config.policy)
            bound = log.bind(job_id=row.id, attempt=row.attempt, failure=failure.describe())
            if isinstance(decision, GiveUp):
                values: dict[str, Any] = {
                    "retry_decision": RetryDecision.GIVE_UP.value,
                    "status_reason": decision.why,
                }
                gave_up.append(row.id)
                bound.info("retry_gave_up", why=decision.why)
            else:
                values = {
                    "retry_decision": RetryDecision.RETRY.value,
                    "next_attempt_at": decision.at,
                    "status_reason": _retry_note(row, failure, decision.at, now, self.config),
                }
                scheduled.append(row.id)
                bound.info(
                    "retry_scheduled",
                    at=decision.at.isoformat(),
                    counts=decision.counts,
                    retry_count=row.retry_count,
                    max_retries=row.max_retries,
                )
            await session.execute(
                update(Job)
                .where(Job.id == row.id, Job.status == JobStatus.FAILED.value, _UNDECIDED)
                .values(updated_at=func.now(), **values)
                .execution_options(synchronize_session=False)
            )
        return scheduled, gave_up

    async def _requeue_due(self, session: AsyncSession) -> list[int]:
        """Move failed jobs whose retry time has come back to `queued`."""
        rows = (
            await session.execute(
                select(
                    Job.id,
                    Job.attempt,
                    Job.failure_reason,
                    Job.exit_code,
                    Job.retry_count,
                    Job.max_retries,
                )
                .where(
                    Job.status == JobStatus.FAILED.value,
                    Job.retry_decision == RetryDecision.RETRY.value,
                    Job.next_attempt_at <= func.now(),
                )
                .order_by(Job.next_attempt_at, Job.id)
                .limit(BATCH)
                .with_for_update(skip_locked=True)
            )
        ).all()
        retried: list[int] = []
        for row in rows:
            counted = counts_against_limit(row.failure_reason, row.exit_code)
            failure = Failure(row.failure_reason, row.exit_code).describe()
            if counted:
                why = f"retry {row.retry_count + 1}/{row.max_retries} after {failure}"
            else:
                why = f"requeued after {failure} (does not count against max_retries)"
            moved = await transition(
                session,
                row.id,
                expected=JobStatus.FAILED,
                to=JobStatus.QUEUED,
                reason=why,
                actor=self.actor,
                values={
                    "retry_count": Job.retry_count + (1 if counted else 0),
                    "next_attempt_at": None,
                    "status_reason": why,
                },
            )
            if moved:
                retried.append(row.id)
                metrics.count_retry(row.failure_reason)
                log.info("job_requeued", job_id=row.id, attempt=row.attempt, why=why)
        return retried

    async def _wake_pending(self, session: AsyncSession) -> list[int]:
        """Put pending jobs back in the queue when GPUs that fit them are free."""
        cfg = self.config
        since_pending = func.extract(
            "epoch", func.now() - func.coalesce(Job.pending_at, Job.submitted_at)
        )
        waited = func.extract("epoch", func.now() - Job.submitted_at)
        rows = (
            await session.execute(
                select(
                    Job.id,
                    Job.gpus_requested,
                    Job.priority,
                    waited.label("waited"),
                    since_pending.label("since_pending"),
                )
                .where(Job.status == JobStatus.PENDING.value)
                .order_by(Job.priority.desc(), Job.id)
                .limit(BATCH)
            )
        ).all()
        if not rows:
            return []
        # Free GPUs counted exactly as the claim query counts them.
        counts = (await session.execute(FREE_BY_VM_SQL)).all()
        free = {vm_id: int(n) for vm_id, n in counts}
        largest_vm = int(await session.scalar(LARGEST_VM_SQL) or 0)
        plan = plan_pending(
            [
                PendingJob(
                    r.id, r.gpus_requested, r.priority, float(r.waited), float(r.since_pending)
                )
                for r in rows
            ],
            free,
            recheck_after_s=cfg.recheck_after_s,
            pending_timeout_s=cfg.pending_timeout_s,
            starvation_after_s=cfg.starvation_after_s,
            largest_vm=largest_vm,
        )
        if plan.held:
            log.info("pending_held_back", held_for=plan.held_for, held=len(plan.held))
        woken: list[int] = []
        for job_id, why in plan.republish:
            reason = (
                "GPUs that fit are free again"
                if why == "capacity"
                else f"pending for {cfg.pending_timeout_s:.0f}s: looking again"
            )
            moved = await transition(
                session,
                job_id,
                expected=JobStatus.PENDING,
                to=JobStatus.QUEUED,
                reason=reason,
                actor=self.actor,
                values={"status_reason": None},
            )
            if moved:
                woken.append(job_id)
                metrics.count_recovery(f"pending_{why}")
        return woken

    async def _to_announce(self, session: AsyncSession) -> list[_Announce]:
        """Queued jobs whose current queued spell was never announced, or long ago."""
        stale_before = func.now() - timedelta(seconds=self.config.republish_after_s)
        # A leftover attempt on a VM that answers is killed first (this very tick); the
        # claim would refuse the job meanwhile anyway.
        rows = (
            await session.execute(
                select(Job.id, Job.attempt, Job.queued_at, Job.published_at)
                .where(
                    Job.status == JobStatus.QUEUED.value,
                    or_(
                        Job.published_at.is_(None),
                        Job.published_at < Job.queued_at,
                        Job.published_at < stale_before,
                    ),
                    ~leftover_may_run(Job.id),
                )
                .order_by(Job.priority.desc(), Job.id)
                .limit(BATCH)
            )
        ).all()
        return [_Announce(r.id, r.attempt, r.queued_at, r.published_at) for r in rows]

    async def _announce(self, items: Sequence[_Announce], report: TickReport) -> None:
        """Publish (no transaction open), then record what the stream stored."""
        if self.publisher is None:
            return
        done: list[_Announce] = []
        for item in items:
            msg_id = announce_msg_id(item.job_id, item.attempt, item.published_at)
            try:
                await self.publisher.publish(item.job_id, msg_id)
            except Exception as exc:  # noqa: BLE001 - NATS down: the next tick tries again
                report.publish_failed = len(items) - len(done)
                log.warning(
                    "publish_failed",
                    job_id=item.job_id,
                    error=(str(exc) or type(exc).__name__)[:200],
                    left=report.publish_failed,
                )
                break
            done.append(item)
        if not done:
            return
        async with self.db.transaction() as session:
            for item in done:
                # Only the queued spell we announced: a job requeued meanwhile needs its own.
                same_spell = (
                    Job.queued_at.is_(None)
                    if item.queued_at is None
                    else Job.queued_at == item.queued_at
                )
                await session.execute(
                    update(Job)
                    .where(and_(Job.id == item.job_id, same_spell))
                    .values(published_at=func.now())
                    .execution_options(synchronize_session=False)
                )
        report.published = [item.job_id for item in done]
        log.info("jobs_announced", count=len(done))

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


# A failed job has no decision yet while its `retry_decision` is NULL (every move clears
# it, so a decision never outlives the failure it was made for).
_UNDECIDED = Job.retry_decision.is_(None)


def _retry_note(
    row: Any, failure: Failure, at: datetime, now: datetime, config: RequeueConfig
) -> str:
    """The status_reason of a failed job waiting for its retry."""
    wait = max(0.0, (at - now).total_seconds())
    if failure.reason == NODE_LOST:
        return (
            f"{failure.describe()}: retrying elsewhere "
            f"(lost nodes {failure.node_lost_count}/{config.policy.node_lost_limit})"
        )
    if is_machine_fault(failure.reason, failure.exit_code):
        return (
            f"{failure.describe()}: the VM's fault, retrying elsewhere "
            f"(VM failures {failure.node_lost_count}/{config.policy.node_lost_limit})"
        )
    return f"{failure.describe()}: retry {row.retry_count + 1}/{row.max_retries} in {wait:.0f}s"


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


if __name__ == "__main__":
    from scheduler.cli.daemons import requeue_main

    requeue_main()
