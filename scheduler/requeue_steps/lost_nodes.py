"""Requeue step: fail the live jobs of VMs that have been unreachable for too long."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.logging import get_logger
from scheduler.models import VM, Job, JobNode
from scheduler.requeue_steps import BATCH
from scheduler.states import FailureReason, JobStatus, VMStatus

log = get_logger("requeue")

NODE_LOST = FailureReason.NODE_LOST.value


async def fail_lost_nodes(session: AsyncSession, *, timeout_s: float, actor: str) -> list[int]:
    """Fail live jobs of VMs unreachable for longer than `timeout_s`; their ids. A job
    fails when the VM of any rank of its attempt (`job_nodes`, rank 0 included) is lost
    (shared fate: every rank becomes a leftover, `attempts.end`)."""
    on_vm = VM.id.in_(
        select(JobNode.vm_id).where(JobNode.job_id == Job.id, JobNode.attempt == Job.attempt)
    )
    outage = func.extract("epoch", func.now() - VM.unreachable_since)
    rows = (
        await session.execute(
            select(*AttemptRecord.columns(), Job.status, VM.name, outage.label("outage_s"))
            .join(VM, on_vm)
            .where(
                Job.status.in_([JobStatus.RUNNING.value, JobStatus.STARTING.value]),
                VM.status == VMStatus.UNREACHABLE.value,
                VM.unreachable_since < func.now() - timedelta(seconds=timeout_s),
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
        moved = await end_attempt(
            session,
            AttemptRecord.from_row(row),
            decide(None, RankEnd(How.LOST, why)),
            expected=JobStatus(row.status),
            actor=actor,
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
