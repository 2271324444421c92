"""Requeue steps: give failed jobs a retry decision, and queue those whose time has come.

The decision itself is `scheduler.retry.decide` (pure); these steps read and write the rows.
"""

from __future__ import annotations

import random
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.jobs import transition
from scheduler.logging import get_logger
from scheduler.models import Job
from scheduler.requeue_steps import BATCH
from scheduler.retry import (
    Failure,
    GiveUp,
    RetryPolicy,
    add_uncounted,
    counts_against_limit,
    decide,
    is_machine_fault,
    uncounted_counts,
)
from scheduler.states import FailureReason, JobStatus, RetryDecision
from scheduler.verdicts import group_reason_detail

log = get_logger("requeue")

NODE_LOST = FailureReason.NODE_LOST.value

# A failed job has no decision yet while its `retry_decision` is NULL (every move clears
# it, so a decision never outlives the failure it was made for).
_UNDECIDED = Job.retry_decision.is_(None)


async def decide_failed(
    session: AsyncSession, now: datetime, *, rng: random.Random, policy: RetryPolicy
) -> tuple[list[int], list[int]]:
    """Stamp the retry decision on failed jobs that have none yet: (scheduled, gave up)."""
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
                Job.uncounted_retries,
                Job.status_reason,
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
        failure = Failure(
            row.failure_reason, row.exit_code, row.machine_faults, row.uncounted_retries
        )
        decision = decide(row, failure, now, rng, policy)
        bound = log.bind(job_id=row.id, attempt=row.attempt, failure=failure.describe())
        # A job group's attempt says which role ended it and why: keep that in view.
        role_why = group_reason_detail(row.status_reason)
        if isinstance(decision, GiveUp):
            values: dict[str, Any] = {
                "retry_decision": RetryDecision.GIVE_UP.value,
                "status_reason": f"{decision.why}: {role_why}" if role_why else decision.why,
            }
            gave_up.append(row.id)
            bound.info("retry_gave_up", why=decision.why)
        else:
            values = {
                "retry_decision": RetryDecision.RETRY.value,
                "next_attempt_at": decision.at,
                "status_reason": retry_note(row, failure, decision.at, now, policy)
                + (f" ({role_why})" if role_why else ""),
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


async def requeue_due(session: AsyncSession, *, actor: str) -> list[int]:
    """Move failed jobs whose retry time has come back to `queued`; their ids."""
    rows = (
        await session.execute(
            select(
                Job.id,
                Job.attempt,
                Job.failure_reason,
                Job.exit_code,
                Job.retry_count,
                Job.max_retries,
                Job.uncounted_retries,
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
            actor=actor,
            values={
                "retry_count": Job.retry_count + (1 if counted else 0),
                "uncounted_retries": (
                    row.uncounted_retries
                    if counted
                    else add_uncounted(row.uncounted_retries, row.failure_reason)
                ),
                "next_attempt_at": None,
                "status_reason": why,
            },
        )
        if moved:
            retried.append(row.id)
            metrics.count_retry(row.failure_reason)
            log.info("job_requeued", job_id=row.id, attempt=row.attempt, why=why)
    return retried


def retry_note(row: Any, failure: Failure, at: datetime, now: datetime, policy: RetryPolicy) -> str:
    """The status_reason of a failed job waiting for its retry."""
    wait = max(0.0, (at - now).total_seconds())
    if failure.reason == NODE_LOST:
        return (
            f"{failure.describe()}: retrying elsewhere "
            f"(lost nodes {failure.node_lost_count}/{policy.node_lost_limit})"
        )
    if is_machine_fault(failure.reason, failure.exit_code):
        return (
            f"{failure.describe()}: the VM's fault, retrying elsewhere "
            f"(VM failures {failure.node_lost_count}/{policy.node_lost_limit})"
        )
    if not counts_against_limit(failure.reason, failure.exit_code):
        done = sum(uncounted_counts(failure.uncounted).values())
        return (
            f"{failure.describe()}: retrying in {wait:.0f}s, not counted against max_retries"
            f" (uncounted retries {done + 1}/{policy.uncounted_limit})"
        )
    return f"{failure.describe()}: retry {row.retry_count + 1}/{row.max_retries} in {wait:.0f}s"
