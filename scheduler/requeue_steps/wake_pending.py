"""Requeue step: put pending jobs back in the queue when GPUs that fit them are free.

Which jobs is `scheduler.pending.plan_pending` (pure, anti-starvation included); this step
loads its inputs and moves the jobs it names.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
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
                Job.id,
                Job.gpus_requested,
                Job.nodes,
                Job.roles,
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
    sizes = [int(n) for n in (await session.execute(VM_SIZES_SQL)).scalars()]
    plan = plan_pending(
        [
            PendingJob(
                r.id,
                r.gpus_requested,
                r.priority,
                float(r.waited),
                float(r.since_pending),
                nodes=r.nodes,
                demands=_group_demands(r.roles, r.nodes),
            )
            for r in rows
        ],
        free,
        recheck_after_s=recheck_after_s,
        pending_timeout_s=pending_timeout_s,
        starvation_after_s=starvation_after_s,
        largest_vm=largest_vm,
        vm_sizes=sizes,
    )
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


def _group_demands(roles: Any, nodes: int) -> tuple[int, ...]:
    """Each node's GPUs of a job group over several VMs; () for any other job (or a row
    whose roles do not read back: the claim fails it)."""
    if roles is None or nodes == 1:
        return ()
    from scheduler.errors import BadInput
    from scheduler.jobspec import parse_data

    try:
        return tuple(node.gpus for node in parse_data(roles).layout())
    except BadInput:
        return ()
