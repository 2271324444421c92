"""Requeue step: publish on `jobs.new` every queued job whose queued spell was never
announced (or was announced long ago), then record what the stream stored.

Choosing runs inside the tick's transaction; publishing runs after it committed, and
`published_at` is set in a short transaction of its own (docs/invariants.md, invariant 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import bus
from scheduler.db import Database
from scheduler.leftovers import leftover_may_run
from scheduler.logging import get_logger
from scheduler.models import Job
from scheduler.requeue_steps import BATCH
from scheduler.states import JobStatus

log = get_logger("requeue")


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
class Announce:
    """A queued job to announce, with the spell and the announcement it was chosen for."""

    job_id: int
    attempt: int
    queued_at: datetime | None
    published_at: datetime | None


@dataclass
class Announced:
    """What `announce` did: the jobs the stream stored, and how many were left unsent."""

    published: list[int] = field(default_factory=list)
    failed: int = 0


def announce_msg_id(job_id: int, attempt: int, published_at: datetime | None) -> str:
    """The `Nats-Msg-Id` for announcing a job again: same state, same id."""
    generation = 0 if published_at is None else int(published_at.timestamp() * 1000)
    return bus.msg_id(job_id, attempt, generation)


async def to_announce(session: AsyncSession, *, republish_after_s: float) -> list[Announce]:
    """Queued jobs whose current queued spell was never announced, or long ago."""
    stale_before = func.now() - timedelta(seconds=republish_after_s)
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
    return [Announce(r.id, r.attempt, r.queued_at, r.published_at) for r in rows]


async def announce(db: Database, publisher: Publisher, items: Sequence[Announce]) -> Announced:
    """Publish (no transaction open), then record what the stream stored."""
    result = Announced()
    done: list[Announce] = []
    for item in items:
        msg_id = announce_msg_id(item.job_id, item.attempt, item.published_at)
        try:
            await publisher.publish(item.job_id, msg_id)
        except Exception as exc:  # noqa: BLE001 - NATS down: the next tick tries again
            result.failed = len(items) - len(done)
            log.warning(
                "publish_failed",
                job_id=item.job_id,
                error=(str(exc) or type(exc).__name__)[:200],
                left=result.failed,
            )
            break
        done.append(item)
    if not done:
        return result
    async with db.transaction() as session:
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
    result.published = [item.job_id for item in done]
    log.info("jobs_announced", count=len(done))
    return result
