"""What the dispatcher writes after a launch: launched attempts `starting → running` in
batched statements, a launch that did not start failed (its attempt a leftover), and a
launch whose job moved on meanwhile killed.

`WriteBatcher` runs a batch write one call at a time, and the items that arrive while it
runs together in the next call, so that statements stay large even when messages trickle
in one by one. The dispatcher has two: one for claim batches, one for marking launched
jobs running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from nats.aio.msg import Msg

from scheduler import metrics
from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.claims.records import Launched, Running, mark_running_batch
from scheduler.claims.result import Claim
from scheduler.db import Database, is_unavailable
from scheduler.kill import kill_attempt
from scheduler.logging import get_logger
from scheduler.states import JobStatus
from scheduler.transport import Transport, VMTarget

from .consumer import DispatchStats, Replies, TransientError, db_error

log = get_logger("dispatcher")

In = TypeVar("In")
Out = TypeVar("Out")


class WriteBatcher(Generic[In, Out]):
    """Runs a batch write one call at a time, and the items that arrive while a call
    runs together in the next one (at most `most` items a call). Under a steady trickle of
    messages each fetch brings only one or two jobs; this keeps the transactions large
    anyway."""

    def __init__(self, run: Callable[[list[In]], Awaitable[list[Out]]], *, most: int) -> None:
        self._run = run
        self._most = most
        self._waiting: list[tuple[list[In], asyncio.Future[list[Out]]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, items: list[In]) -> list[Out]:
        """One result per item, in order; raises what the batch operation raised."""
        future: asyncio.Future[list[Out]] = asyncio.get_running_loop().create_future()
        self._waiting.append((items, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            group = [self._waiting.pop(0)]
            size = len(group[0][0])
            while self._waiting and size + len(self._waiting[0][0]) <= self._most:
                group.append(self._waiting.pop(0))
                size += len(group[-1][0])
            try:
                results = await self._run([item for items, _ in group for item in items])
            except Exception as exc:  # noqa: BLE001 - handed to every caller of this round
                for _items, future in group:
                    if not future.done():
                        future.set_exception(exc)
                continue
            start = 0
            for items, future in group:
                if not future.done():
                    future.set_result(results[start : start + len(items)])
                start += len(items)


@dataclass(frozen=True)
class Launch:
    """A claimed attempt its VM started, and the message that asked for it."""

    msg: Msg
    claim: Claim
    target: VMTarget
    pid: int
    path: str | None
    """The attempt's absolute directory, as its launch reported it."""


class Records:
    """The writes after launches: running, failed, superseded (and its kill)."""

    def __init__(
        self,
        db: Database,
        transport: Transport,
        stats: DispatchStats,
        *,
        actor: str,
        kill_grace_s: float,
        most: int,
    ) -> None:
        self.db = db
        self.transport = transport
        self.stats = stats
        self.actor = actor
        self.kill_grace_s = kill_grace_s
        self._runs = WriteBatcher(self._mark_running, most=most)

    async def _mark_running(self, batch: list[Launched]) -> list[Running | None]:
        async with self.db.engine.begin() as conn:  # hot path: no ORM session
            moved = await mark_running_batch(conn, batch, actor=self.actor)
        return [moved.get(x.job_id) for x in batch]

    async def record_running(self, launched: list[Launch], replies: Replies) -> None:
        """Move every launched attempt `starting → running` in one statement, then ack;
        an attempt whose job moved on meanwhile is killed."""
        batch = [
            Launched(
                x.claim.job_id,
                x.claim.attempt,
                x.pid,
                f"pid {x.pid} on {x.target.name}",
                attempt_dir=x.path,
            )
            for x in launched
        ]
        try:
            moved = {
                x.job_id: running
                for x, running in zip(batch, await self._runs.submit(batch), strict=True)
                if running is not None
            }
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            # The processes run; the leases will bring the claims back if we never can.
            error = TransientError(db_error(exc))
            for x in launched:
                await replies.defer(x.msg, x.claim.job_id, error)
            return
        superseded = []
        for x in launched:
            running = moved.get(x.claim.job_id)
            if running is None:
                superseded.append(self._supersede(replies, x))
                continue
            metrics.observe_queue_wait(running.queued_at, running.starting_at)
            metrics.observe_running(running.submitted_at, running.running_at)
            self.stats.launched += 1
            log.info(
                "job_running",
                job_id=x.claim.job_id,
                vm=x.target.name,
                attempt=x.claim.attempt,
                pid=x.pid,
                gpus=x.claim.gpu_indices,
            )
            await replies.reply(x.msg, "running")
        await asyncio.gather(*superseded)

    async def _supersede(self, replies: Replies, x: Launch) -> None:
        """Cancelled, or the lease expired, while we launched: this attempt must not run."""
        bound = log.bind(job_id=x.claim.job_id, vm=x.target.name, attempt=x.claim.attempt)
        bound.warning("launch_superseded", pid=x.pid)
        await self._kill_quietly(x.claim, x.target, x.path)
        self.stats.skipped += 1
        await replies.reply(x.msg, "superseded")

    async def fail(
        self, replies: Replies, msg: Msg, claim: Claim, target: VMTarget, error: str
    ) -> None:
        """Record a launch that did not start, then ack (or nak when the DB is away)."""
        try:
            await self._launch_failed(claim, target, error)
        except TransientError as exc:
            await replies.defer(msg, claim.job_id, exc)
            return
        await replies.reply(msg, "failed")

    async def _launch_failed(self, claim: Claim, target: VMTarget, error: str) -> None:
        bound = log.bind(job_id=claim.job_id, vm=target.name, attempt=claim.attempt)
        bound.warning("launch_failed", error=error)
        reason = f"launch failed: {error}"[:500]
        try:
            async with self.db.transaction() as session:
                # The launch may have started after all (a timeout, a dropped link): its
                # attempt is a leftover, its GPUs out of use until it is known to be dead.
                moved = await end_attempt(
                    session,
                    AttemptRecord(
                        claim.job_id,
                        claim.attempt,  # not the next attempt, if the lease ran out
                        target.id,
                        claim.gpu_indices,
                        claim.gpu_uuids,
                        claim.token,
                    ),
                    decide(None, RankEnd(How.LAUNCH_REFUSED, reason)),
                    expected=JobStatus.STARTING,
                    actor=self.actor,
                )
        except Exception as exc:
            if is_unavailable(exc):
                raise TransientError(db_error(exc)) from exc
            raise
        if moved:
            self.stats.launch_failed += 1
        else:
            # Cancelled, or its lease ran out, while the launch was on the wire: a launch
            # that a kill fenced off fails this way, and nothing of it runs.
            self.stats.skipped += 1
            bound.info("launch_superseded", error=error)

    async def _kill_quietly(self, claim: Claim, target: VMTarget, path: str | None) -> None:
        """Kill a superseded attempt. Its job has moved on without it, and whoever moved it
        (cancel, an expired lease) recorded this attempt as a leftover, which keeps its GPUs
        blocked until the attempt is known dead: a failed kill here is retried by the requeue
        manager."""
        kill = await kill_attempt(
            self.transport,
            target,
            claim.attempt_ref.located(path),
            grace_s=self.kill_grace_s,
            launched=True,
        )
        if not kill.dead:
            log.warning("kill_failed", job_id=claim.job_id, vm=target.name, outcome=kill.describe())
