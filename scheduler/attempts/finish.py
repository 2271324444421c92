"""Carrying out the end of an attempt: `end_attempt` applies what the one rule
(`attempts.end.decide`) said, in the caller's transaction: the job moves (`jobs.transition`,
guarded by its state and by that attempt), every rank that may still run is recorded as a
leftover (the ledger of `scheduler.leftovers`), then the job's GPUs are given back, in
that order, so that the recount of a VM's free GPUs already leaves the leftovers' out.
Every caller that ends an attempt (the poller's finish, stalls and GPU faults, lost and
removed VMs, an expired lease, a failed launch, a cancel, a late success) goes through
it. No network I/O: the kill of what is left runs after the transaction, elsewhere."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler.attempts.end import End, Outcome
from scheduler.gpus import release_in_session
from scheduler.jobs import transition
from scheduler.models import Job, JobNode, Leftover
from scheduler.states import JobStatus


async def end_attempt(
    session: AsyncSession,
    record: AttemptRecord,
    end: End,
    *,
    expected: JobStatus | Iterable[JobStatus],
    actor: str,
    values: Mapping[str, Any] | None = None,
) -> bool:
    """Carry out `end` on the job's attempt `record` (caller's transaction), when the job
    is in `expected` at that attempt: the columns its move sets follow from the decision
    (`end_values`), `values` adds or overrides some (where a late success ran). Returns
    False, having changed nothing, when the job had moved, or when the attempt goes on."""
    to = end.to
    if to is None:
        return False
    changes = end_values(end, record.attempt)
    changes.update(values or {})
    return await abandon_attempt(
        session,
        record,
        expected=expected,
        to=to,
        reason=end.why[:500],
        actor=actor,
        leftover=end.leftover,
        failure_reason=end.failure.value if end.failure is not None else None,
        values=changes,
        ended=end.ended,
    )


def end_values(end: End, attempt: int) -> dict[str, Any]:
    """The job columns a move after `end` sets, beside those `abandon_attempt` sets."""
    if end.outcome is Outcome.SUCCEEDS:
        return {
            "exit_code": 0,
            "failure_reason": None,
            "status_reason": end.why[:500],
            "completed_attempt": attempt,
            "next_attempt_at": None,
        }
    if end.outcome is Outcome.FAILS:
        return {"exit_code": end.exit_code}
    if end.outcome is Outcome.REQUEUED:
        return {"published_at": None}
    return {"status_reason": end.why[:500]}


# -- the attempt a job row names ---------------------------------------------------------


@dataclass(frozen=True)
class AttemptRecord:
    """A job's current attempt as its row records it: which attempt, and the token a kill
    finds its directories by. `abandon_attempt` reads the attempt's ranks (where each runs)
    from `job_nodes`, not from here: the VM, GPU, directory and pid fields (the job row's
    copy of rank 0's) are not read by it, and only kept while callers still pass them."""

    job_id: int
    attempt: int
    vm_id: int | None
    gpu_indices: Sequence[int] | None = None
    gpu_uuids: Sequence[str] | None = None
    token: str | None = None
    attempt_dir: str | None = None
    pid: int | None = None

    @staticmethod
    def columns() -> tuple[Any, ...]:
        """The job columns `from_row` reads, to select along with others."""
        return (
            Job.id,
            Job.attempt,
            Job.vm_id,
            Job.gpu_indices,
            Job.gpu_uuids,
            Job.launch_token,
            Job.attempt_dir,
            Job.remote_pid,
        )

    @classmethod
    def from_row(cls, row: Any) -> AttemptRecord:
        """The record of a row selected with `columns()`."""
        return cls(
            row.id,
            row.attempt,
            row.vm_id,
            row.gpu_indices,
            row.gpu_uuids,
            row.launch_token,
            row.attempt_dir,
            row.remote_pid,
        )


async def abandon_attempt(
    session: AsyncSession,
    record: AttemptRecord,
    *,
    expected: JobStatus | Iterable[JobStatus],
    to: JobStatus,
    reason: str,
    actor: str,
    leftover: str | None,
    failure_reason: str | None = None,
    values: Mapping[str, Any] | None = None,
    ended: Collection[int] = (),
) -> bool:
    """Move the job off its current attempt `record` (caller's transaction): transition
    to `to` guarded by `expected` and by that attempt; then, when `leftover` names why,
    every rank of the attempt (`job_nodes`) is recorded as a leftover on its VM, except the
    ranks in `ended` (known to have ended: nothing of them is left to kill); then the job's
    GPUs are freed.

    The lease is always cleared. A move to `failed` also sets `failure_reason`, clears the
    exit code and any retry decision, and shows `reason` as the status reason. `values`
    sets (or overrides) more columns in the same UPDATE. Returns False, having changed
    nothing, when the job was not in `expected` at that attempt.
    """
    changes: dict[str, Any] = {"lease_expires_at": None}
    if to == JobStatus.FAILED:
        changes.update(
            failure_reason=failure_reason,
            exit_code=None,
            status_reason=reason,
            next_attempt_at=None,
        )
    changes.update(values or {})
    moved = await transition(
        session,
        record.job_id,
        expected=expected,
        to=to,
        reason=reason,
        actor=actor,
        values=changes,
        attempt=record.attempt,
    )
    if not moved:
        return False
    if leftover is not None:
        await _record_ranks(session, record, leftover, ended)
    await release_in_session(session, record.job_id)
    return True


async def _record_ranks(
    session: AsyncSession, record: AttemptRecord, reason: str, ended: Collection[int] = ()
) -> None:
    """Every rank of the record's attempt (`job_nodes`, one row per VM, rank 0 and a
    single-node job's one rank included) is a leftover, by shared fate, unless it is in
    `ended`: each is killed by the sweep when its VM answers, its GPUs blocked until then.
    Each row keeps its rank and the exit code `job_nodes` knew (what late success reads,
    `_ranks_succeeded`). A rank whose VM row was removed has nothing to kill."""
    ranks = (
        await session.execute(
            select(
                JobNode.rank, JobNode.vm_id, JobNode.gpu_indices, JobNode.gpu_uuids,
                JobNode.attempt_dir, JobNode.remote_pid, JobNode.exit_code,
            ).where(
                JobNode.job_id == record.job_id,
                JobNode.attempt == record.attempt,
                JobNode.vm_id.is_not(None),
            )
        )
    ).all()  # fmt: skip
    for rank in ranks:
        if rank.rank in ended:
            continue
        await record_leftover(
            session,
            vm_id=rank.vm_id,
            job_id=record.job_id,
            attempt=record.attempt,
            gpu_indices=rank.gpu_indices,
            gpu_uuids=rank.gpu_uuids,
            reason=reason,
            token=record.token,
            attempt_dir=rank.attempt_dir,
            pid=rank.remote_pid,
            rank=rank.rank,
            exit_code=rank.exit_code,
        )


# -- the ledger: where a leftover is written ------------------------------------------


async def record_leftover(
    session: AsyncSession,
    *,
    vm_id: int,
    job_id: int,
    attempt: int,
    gpu_indices: Sequence[int] | None,
    reason: str,
    token: str | None,
    attempt_dir: str | None = None,
    pid: int | None = None,
    gpu_uuids: Sequence[str] | None = None,
    rank: int | None = None,
    exit_code: int | None = None,
) -> None:
    """Note an attempt that may still run on its VM (caller's transaction): its GPUs are
    kept out of every claim, and its job is not claimed again, until a kill proves it
    dead (`close_leftover`). Once per (VM, job, attempt). `token` and `attempt_dir` are the
    job row's for that attempt: the kill finds its directory by them."""
    await session.execute(
        pg_insert(Leftover)
        .values(
            vm_id=vm_id,
            job_id=job_id,
            attempt=attempt,
            launch_token=token,
            attempt_dir=attempt_dir,
            pid=pid,
            gpu_indices=list(gpu_indices) if gpu_indices else None,
            gpu_uuids=list(gpu_uuids) if gpu_uuids else None,
            reason=reason,
            rank=rank,
            exit_code=exit_code,
        )
        .on_conflict_do_nothing()
    )
