"""How the poller finishes attempts: the live ranks it probes (`load_ranks`, one per VM
of every live attempt, rank 0 and single-node jobs included) and what it does with a probed
rank's verdict (`finish_rank`, the one way every kind of attempt is finished: the one
end-of-attempt rule of `scheduler.attempts.end`, carried out by `attempts.finish.end_attempt`).

What a probed attempt's state means for its job is decided without I/O in
`scheduler.verdicts`; this module applies it, one short transaction per job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import case, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.attempts.ranks import exit_codes, job_shape
from scheduler.db import Database
from scheduler.gpu_poller.state import Outcome, VMState
from scheduler.logging import get_logger
from scheduler.models import Job, JobNode
from scheduler.remote.layout import stored_attempt
from scheduler.states import LIVE_STATES, FailureReason, JobStatus
from scheduler.verdicts import JobVerdict, LiveJob, job_verdict, untracked_verdict

log = get_logger("gpu_poller")

ACTOR = "poller"

# Written with the failed job, so that no claim lands on the VM before the sweep's end.
_VM_LAUNCH_BROKEN_SQL = text(
    """
UPDATE vms SET launch_error = :error, last_error = :error, status = 'unhealthy'
WHERE id = :vm_id
"""
)


async def finish_jobs(db: Database, outcomes: Sequence[Outcome]) -> int:
    """Move the jobs whose attempts these polls found ended (one short transaction
    each, GPUs freed in it), noting them on their outcome; how many moved."""
    finished = 0
    for outcome in outcomes:
        if outcome.result is None:
            continue
        for job in outcome.vm.jobs:
            if job.attempt is None:
                verdict = untracked_verdict(job)
            else:
                verdict = job_verdict(job, outcome.result.jobs.get((job.id, job.attempt_number)))
            if verdict is not None and await _finish(db, outcome.vm, verdict):
                outcome.finished.add(job.id)
                outcome.launch_error = verdict.vm_error or outcome.launch_error
                finished += 1
    return finished


async def _finish(db: Database, vm: VMState, verdict: JobVerdict) -> bool:
    """Apply one verdict on a rank probed on `vm`: whether its job moved."""
    job = verdict.job
    async with db.transaction() as session:
        moved = await finish_rank(session, verdict, vm.target.name)
        if moved and verdict.vm_error is not None:
            await session.execute(
                _VM_LAUNCH_BROKEN_SQL, {"vm_id": vm.target.id, "error": verdict.vm_error}
            )
    if moved and verdict.vm_error is not None:
        log.warning("vm_cannot_launch", vm=vm.target.name, error=verdict.vm_error)
    if moved:
        log.info(
            "job_finished",
            job_id=job.id,
            vm=vm.target.name,
            attempt=job.attempt_number,
            status=verdict.to.value,
            exit_code=verdict.exit_code,
            failure_reason=verdict.failure_reason,
        )
        if verdict.failure_reason is not None:
            metrics.count_failure(verdict.failure_reason.value)
    return moved


async def load_ranks(session: AsyncSession, installation: str) -> list[LiveJob]:
    """Every rank of every live attempt (`job_nodes`, one row per VM, rank 0 and
    single-node jobs included), each to be probed (and its lease renewed) on its own VM
    like any other. A live row that no claim placed (written by hand or by a bug: no
    `job_nodes` rows for its attempt) is read as its rank 0 from the job row, so that the
    probe resolves it like any other attempt (docs/security.md)."""
    placed = (JobNode.job_id == Job.id) & (JobNode.attempt == Job.attempt)
    unplaced = JobNode.job_id.is_(None)

    def column(of_rank: Any, of_job: Any, name: str) -> Any:
        return case((unplaced, of_job), else_=of_rank).label(name)

    vm_id = column(JobNode.vm_id, Job.vm_id, "vm_id")
    rows = await session.execute(
        select(
            Job.id,
            Job.status,
            Job.attempt,
            Job.launch_token,
            Job.nodes,
            column(JobNode.rank, 0, "rank"),
            vm_id,
            column(JobNode.remote_pid, Job.remote_pid, "remote_pid"),
            column(JobNode.attempt_dir, Job.attempt_dir, "attempt_dir"),
        )
        .outerjoin(JobNode, placed)
        .where(
            Job.status.in_([s.value for s in LIVE_STATES]),
            Job.attempt >= 1,
            case((unplaced, Job.vm_id), else_=JobNode.vm_id).is_not(None),
        )
    )
    return [
        LiveJob(
            row.id,
            row.vm_id,
            row.status,
            row.attempt,
            row.remote_pid,
            stored_attempt(installation, row.id, row.attempt, row.launch_token, row.attempt_dir),
            rank=row.rank,
            nodes=row.nodes,
        )
        for row in rows
    ]


async def finish_rank(session: AsyncSession, verdict: JobVerdict, vm_name: str) -> bool:
    """One rank of a live attempt ended (caller's transaction): the one way the poller
    finishes every kind of attempt (one VM, several VMs, a group), rank 0 like any other.

    The rank's end is noted on its `job_nodes` row (`job show` says which rank ended it,
    and how); what it means for the attempt is the one end-of-attempt rule's to say
    (`attempts.end.decide`: success once every primary rank exited 0, shared fate on a
    failure), and `attempts.finish.end_attempt` carries it out. Returns whether the job
    moved (False also when the attempt goes on, or is no longer that attempt: moved by
    someone else, or requeued and relaunched since the probe)."""
    job = verdict.job
    done = verdict.to == JobStatus.COMPLETED
    code = 0 if done else verdict.exit_code
    if code is not None:
        await session.execute(
            update(JobNode)
            .where(
                JobNode.job_id == job.id,
                JobNode.rank == job.rank,
                JobNode.attempt == job.attempt_number,
            )
            .values(exit_code=code)
        )
    record = await _attempt_record(session, job)
    shape = await job_shape(session, job.id)
    if record is None or shape is None:
        return False
    why = verdict.reason if job.nodes == 1 else f"rank {job.rank} on {vm_name}: {verdict.reason}"
    ended = RankEnd(
        How.EXITED,
        why if not done else verdict.reason,
        rank=job.rank,
        exit_code=code,
        failure=None if done else verdict.failure_reason or FailureReason.EXIT_NONZERO,
    )
    end = decide(shape, ended, await exit_codes(session, job.id, job.attempt_number))
    return await end_attempt(session, record, end, expected=LIVE_STATES, actor=ACTOR)


async def _attempt_record(session: AsyncSession, job: LiveJob) -> AttemptRecord | None:
    """The job's current attempt as `end_attempt` takes it, if it is still `job`'s."""
    row = (
        await session.execute(
            select(*AttemptRecord.columns()).where(
                Job.id == job.id, Job.attempt == job.attempt_number
            )
        )
    ).first()
    return None if row is None else AttemptRecord.from_row(row)
