"""Submitting a job: insert it (short transaction), then publish its id (no transaction)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import bus
from scheduler.db import Database
from scheduler.jobs import JobSpec, insert_job, mark_published
from scheduler.settings import Settings, redact_url


@dataclass(frozen=True)
class Submitted:
    """The new job's id, and why it was not published if it was not."""

    job_id: int
    publish_error: str | None = None


async def submit_job(db: Database, settings: Settings, spec: JobSpec, *, actor: str) -> Submitted:
    """Insert the job as `queued`, then publish its id to `jobs.new`.

    The row is committed first, so a NATS outage loses nothing: the requeue manager
    publishes queued jobs whose `published_at` is NULL.
    """
    async with db.transaction() as session:
        job = await insert_job(session, spec, actor=actor)
        job_id, attempt = job.id, job.attempt
    return Submitted(job_id, await announce(db, settings, job_id, bus.msg_id(job_id, attempt)))


async def announce(db: Database, settings: Settings, job_id: int, msg_id: str) -> str | None:
    """Publish a queued job's id to `jobs.new` (no transaction open), then record that it
    was announced. Returns why it did not reach NATS, or None; a job left unannounced is
    announced by the requeue manager, so nothing is lost either way.

    `msg_id` is the `Nats-Msg-Id` the requeue manager would use for the same queued spell
    (`bus.msg_id(job_id, attempt)`), so that a race between the two publishes once."""
    try:
        nc = await bus.connect(settings, name="rlfleet-cli")
    except Exception as exc:  # noqa: BLE001 - any connect failure means "not published"
        reason = str(exc) or type(exc).__name__
        return f"cannot reach NATS at {redact_url(settings.nats_url)}: {reason}"
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        await bus.publish_job(js, job_id, dedupe_id=msg_id)
    except Exception as exc:  # noqa: BLE001
        return f"publishing to {bus.SUBJECT_NEW} failed: {exc or type(exc).__name__}"
    finally:
        await nc.close()
    async with db.transaction() as session:
        await mark_published(session, job_id)
    return None
