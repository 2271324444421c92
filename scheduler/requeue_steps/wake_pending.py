"""Requeue step: put pending jobs back in the queue when GPUs that fit them are free.

Which jobs is `scheduler.pending.plan_pending` (pure, anti-starvation included); this step
loads its inputs — each job's shape (`attempts.shape`), the free GPUs, and the claim-time
rules' states (`claims.rules`, loaded as a claim loads them) — and moves the jobs it names.
A job a rule refuses is not woken, and its reason becomes the rule's words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.attempts.shape import JobShape
from scheduler.claims.rules import RULE_COLUMNS, ClaimGate
from scheduler.gpus import FREE_BY_VM_SQL, LARGEST_VM_SQL, VM_SIZES_SQL
from scheduler.jobs import transition
from scheduler.logging import get_logger
from scheduler.models import Job
from scheduler.pending import PendingJob, plan_pending
from scheduler.requeue_steps import BATCH
from scheduler.states import JobStatus

log = get_logger("requeue")


async def wake_pending(
    session: AsyncSession,
    *,
    recheck_after_s: float,
    pending_timeout_s: float,
    starvation_after_s: float,
    actor: str,
) -> list[int]:
    """Move the pending jobs `plan_pending` picks back to `queued`; their ids."""
    since_pending = func.extract(
        "epoch", func.now() - func.coalesce(Job.pending_at, Job.submitted_at)
    )
    waited = func.extract("epoch", func.now() - Job.submitted_at)
    rows = (
        await session.execute(
            select(
                *RULE_COLUMNS,
                Job.status_reason,
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
    sizes = [int(n) for n in (await session.execute(VM_SIZES_SQL)).scalars()]
    gate = await ClaimGate.load(await session.connection(), rows)
    plan = plan_pending(
        [_pending_job(r) for r in rows],
        free,
        recheck_after_s=recheck_after_s,
        pending_timeout_s=pending_timeout_s,
        starvation_after_s=starvation_after_s,
        largest_vm=largest_vm,
        vm_sizes=sizes,
        gate=gate,
    )
    await _say_refused(session, rows, plan.refused)
    if plan.held:
        log.info("pending_held_back", held_for=plan.held_for, held=len(plan.held))
    woken: list[int] = []
    for job_id, why in plan.republish:
        reason = (
            "GPUs that fit are free again"
            if why == "capacity"
            else f"pending for {pending_timeout_s:.0f}s: looking again"
        )
        moved = await transition(
            session,
            job_id,
            expected=JobStatus.PENDING,
            to=JobStatus.QUEUED,
            reason=reason,
            actor=actor,
            values={"status_reason": None},
        )
        if moved:
            woken.append(job_id)
            metrics.count_recovery(f"pending_{why}")
    return woken


def _pending_job(row: Any) -> PendingJob:
    """A pending job row as the planner sees it: its GPUs per node from its shape."""
    shape = JobShape.of_row(row)
    return PendingJob(
        row.id,
        shape.gpus,
        row.priority,
        float(row.waited),
        float(row.since_pending),
        nodes=shape.nodes,
        demands=shape.demands,
    )


async def _say_refused(
    session: AsyncSession, rows: Sequence[Any], refused: Sequence[tuple[int, str]]
) -> None:
    """A job a rule refuses waits with the rule's words (written only when they changed)."""
    said = {r.id: r.status_reason for r in rows}
    for job_id, reason in refused:
        if said.get(job_id) != reason:
            await session.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.PENDING.value)
                .values(status_reason=reason)
            )
