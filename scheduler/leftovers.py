"""Leftovers: attempts that may still run on their VM after their job has moved on.

A job leaves an attempt behind whenever it moves while that attempt may still have a
process on its VM: a lost VM (`node_lost`), a removed one (`vm_removed`), a launch whose
answer never came (`launch_failed`), an expired claim lease, a cancel, or an older attempt
that turned out to have succeeded (`superseded`). Until a kill proves such an attempt dead,
its GPUs are offered to no claim (`scheduler.gpus.LEFTOVER_GPUS`) and its job is not
claimed again while the VM answers (`leftover_may_run`): two attempts of a job never run
side by side and no GPU is given twice (docs/invariants.md, invariants 1 and 2).

This module is the one home of the concept:

- the ledger (the table `leftovers`, ORM `models.Leftover`): `close_leftover`,
  `leftover_may_run`, `open_leftover_count`, `open_leftover_on_vm`; its rows are written
  (`record_leftover`) by the one way a job leaves its current attempt,
  `attempts.finish.end_attempt`, re-exported here with `AttemptRecord`.
- `LeftoverSweep`: the requeue manager's kill sweep over open rows on VMs that answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Exists, exists, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.attempts.end import End, How, Outcome, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.attempts.finish import (  # where callers have always found them
    abandon_attempt as abandon_attempt,
)
from scheduler.attempts.finish import (
    record_leftover as record_leftover,
)
from scheduler.attempts.ranks import exit_codes, job_shape
from scheduler.db import Database, installation_id
from scheduler.kill import KillResult, kill_attempt
from scheduler.logging import get_logger
from scheduler.models import VM, Job, JobEvent, JobNode, Leftover
from scheduler.remote.layout import Attempt, stored_attempt
from scheduler.remote.watchdog import fenced_script, parse_fenced
from scheduler.states import FINAL_STATES, LIVE_STATES, JobStatus, VMStatus
from scheduler.transport import Transport, TransportError, VMTarget

log = get_logger("leftovers")

MAX_KILL_WAITS = 5
"""Failed kills of a job's leftover after which its next attempt may start anyway (the
leftover's GPUs stay blocked): a VM that answers SSH but cannot kill must not hold a job
back for ever."""
SWEEP_BATCH = 500
"""Most open rows one sweep kills; the rest wait for the next one."""
FENCED_READ_TIMEOUT_S = 10.0


# -- the ledger ---------------------------------------------------------------------------


async def close_leftover(
    session: AsyncSession,
    *,
    vm_id: int,
    job_id: int,
    attempt: int,
    error: str | None = None,
    exit_code: int | None = None,
) -> None:
    """Count one kill of a leftover: with no `error` it is dead, and its GPUs and job are
    free again; otherwise remember why not (the sweep tries again). `exit_code`: the kill
    found it had already exited with that code."""
    values: dict[str, Any] = {"attempts": Leftover.attempts + 1, "last_error": error}
    if error is None:
        values["killed_at"] = func.now()
    if exit_code is not None:
        values["exit_code"] = exit_code
    await session.execute(
        update(Leftover)
        .where(
            Leftover.vm_id == vm_id,
            Leftover.job_id == job_id,
            Leftover.attempt == attempt,
            Leftover.killed_at.is_(None),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def leftover_may_run(job_id: Any) -> Exists:
    """Whether an earlier attempt of the job may still run on a VM that answers, and is
    still being killed. Such a job is neither claimed nor announced until the kill is done,
    so that two attempts never run side by side (docs/invariants.md, invariant 2). One on a VM that
    does not
    answer cannot be waited for (`node_lost` retries it elsewhere)."""
    return (
        select(Leftover.id)
        .join(VM, VM.id == Leftover.vm_id)
        .where(
            Leftover.job_id == job_id,
            Leftover.killed_at.is_(None),
            Leftover.attempts < MAX_KILL_WAITS,
            VM.status != VMStatus.UNREACHABLE.value,
        )
        .exists()
    )


def open_leftover_on_vm(vm_id: Any) -> Exists:
    """Whether the VM has a leftover not yet killed (a VM being removed waits for none)."""
    return exists().where(Leftover.vm_id == vm_id, Leftover.killed_at.is_(None))


async def open_leftover_count(session: AsyncSession, vm_id: int) -> int:
    """How many leftovers on the VM are still to be killed."""
    count = await session.scalar(
        select(func.count())
        .select_from(Leftover)
        .where(Leftover.vm_id == vm_id, Leftover.killed_at.is_(None))
    )
    return int(count or 0)


# -- the kill sweep -----------------------------------------------------------------------


async def _late_end(session: AsyncSession, item: _Open, why: str) -> End | None:
    """What the one end-of-attempt rule (`attempts.end.decide`) says of the leftover's
    attempt now that this rank was found exited 0 (None: no such job), from what is known
    of each rank: the ledger rows of that attempt (kept whatever a newer claim did to
    `job_nodes`), and `job_nodes` while they are still that attempt's, where a rank that
    had exited 0 is noted for `job show`. Caller's transaction."""
    at_attempt = (JobNode.job_id == item.job_id) & (JobNode.attempt == item.attempt)
    await session.execute(
        update(JobNode)
        .where(at_attempt, JobNode.vm_id == item.target.id, JobNode.exit_code.is_(None))
        .values(exit_code=0)
    )
    shape = await job_shape(session, item.job_id)
    if shape is None:
        return None
    codes = await exit_codes(session, item.job_id, item.attempt)
    ledger = await session.execute(
        select(Leftover.rank, Leftover.exit_code).where(
            Leftover.job_id == item.job_id,
            Leftover.attempt == item.attempt,
            Leftover.rank.is_not(None),
            Leftover.exit_code.is_not(None),
        )
    )
    for rank, code in ledger.all():
        if rank is not None and codes.get(rank) is None:
            codes[rank] = code
    # A row recorded before ledger rows named their rank is a single-node job's rank 0.
    rank = item.rank if item.rank is not None else 0
    return decide(shape, RankEnd(How.EXITED, why, rank=rank, exit_code=0), codes)


@dataclass(frozen=True)
class _Open:
    """An open ledger row, as the kill needs it."""

    job_id: int
    attempt: int
    target: VMTarget
    run: Attempt | None
    pid: int | None
    gpu_indices: list[int] | None
    rank: int | None = None


@dataclass
class SweepReport:
    """What one sweep did: the jobs whose leftover it proved dead, and the failed kills."""

    killed: list[int] = field(default_factory=list)
    kill_failed: int = 0


_KILLABLE: ColumnElement[bool] = VM.status != VMStatus.UNREACHABLE.value
"""Any VM that answers SSH (healthy, or GPUs in trouble) can have its leftovers killed."""


class LeftoverSweep:
    """Kill leftovers on VMs that answer; close their rows once dead. `sweep()` is one pass
    (the requeue manager's step 6)."""

    def __init__(self, db: Database, transport: Transport, *, grace_s: float, actor: str) -> None:
        self.db = db
        self.transport = transport
        self.grace_s = grace_s
        self.actor = actor

    async def sweep(self) -> SweepReport:
        """Load open rows (short transaction), kill them (SSH, none open), record what the
        kills found (short transaction). A leftover that had exited 0 may complete its job
        (`_late_success`)."""
        report = SweepReport()
        work = await self._load()
        if not work:
            return report
        results = await asyncio.gather(*(self._kill_one(item) for item in work))
        async with self.db.transaction() as session:
            for item, (kill, fenced) in zip(work, results, strict=True):
                error = None if kill.dead else kill.describe()[:500]
                await close_leftover(
                    session,
                    vm_id=item.target.id,
                    job_id=item.job_id,
                    attempt=item.attempt,
                    error=error,
                    exit_code=kill.exit_code if kill.outcome == "gone" else None,
                )
                if error is None:
                    report.killed.append(item.job_id)
                    if fenced is not None:
                        await self._note(session, item, fenced)
                else:
                    report.kill_failed += 1
                if kill.outcome == "gone" and kill.exit_code == 0 and item.run is not None:
                    await self._late_success(session, item, kill)
        return report

    async def _load(self) -> list[_Open]:
        """The open rows on VMs that answer, fewest kill attempts first (rows that keep
        failing cannot starve the rest)."""
        async with self.db.transaction() as session:
            rows = (
                await session.execute(
                    select(Leftover, VM)
                    .join(VM, VM.id == Leftover.vm_id)
                    .where(Leftover.killed_at.is_(None), _KILLABLE)
                    .order_by(Leftover.attempts, Leftover.id)
                    .limit(SWEEP_BATCH)
                )
            ).all()
            installation = await installation_id(session) if rows else ""
            return [
                _Open(
                    row.job_id,
                    row.attempt,
                    VMTarget.from_vm(vm),
                    stored_attempt(
                        installation, row.job_id, row.attempt, row.launch_token, row.attempt_dir
                    ),
                    row.pid,
                    row.gpu_indices,
                    row.rank,
                )
                for row, vm in rows
            ]

    async def _kill_one(self, item: _Open) -> tuple[KillResult, str | None]:
        """Kill one leftover: its result, dead once it surely runs no more, and then why its
        watchdog had fenced it, if it did."""
        bound = log.bind(job_id=item.job_id, attempt=item.attempt, vm=item.target.name)
        if item.run is None:
            # No launch token: no directory of this installation can be the attempt's.
            bound.info("leftover_untraceable")
            return KillResult("gone"), None
        kill = await kill_attempt(
            self.transport,
            item.target,
            item.run,
            grace_s=self.grace_s,
            launched=item.pid is not None,
        )
        if not kill.dead:
            bound.warning("leftover_kill_failed", outcome=kill.describe()[:200])
            return kill, None
        bound.info("leftover_killed", outcome=kill.outcome, exit_code=kill.exit_code)
        return kill, await self._fenced(item)

    async def _late_success(self, session: AsyncSession, item: _Open, kill: KillResult) -> None:
        """One success is enough (docs/decisions.md): a leftover that turns out to have
        exited 0 completes its job, unless the job has ended meanwhile. A newer attempt
        still starting or running is superseded: it becomes a leftover itself (its GPUs stay
        blocked until the next sweep has killed it), and the row names the VM and directory
        of the attempt whose output is the result. A leftover is one rank of its attempt (the
        only one, for a single-node job): the job completes once the one end-of-attempt rule
        says the attempt succeeded (`_late_end`). Caller's transaction."""
        assert item.run is not None
        job = (
            await session.execute(
                select(Job.status, Job.output_dir, Job.nodes, *AttemptRecord.columns())
                .where(Job.id == item.job_id)
                .with_for_update()
            )
        ).one_or_none()
        bound = log.bind(job_id=item.job_id, attempt=item.attempt, vm=item.target.name)
        if job is None or JobStatus(job.status) in FINAL_STATES or job.attempt < item.attempt:
            bound.info("late_success_ignored", status=job.status if job else None)
            return
        status = JobStatus(job.status)
        newer = job.attempt > item.attempt and status in LIVE_STATES
        where = kill.path or item.run.word()
        reason = (
            f"attempt {item.attempt} on {item.target.name} had exited 0 after it was given up"
            f" for lost: its output is in {job.output_dir} on {item.target.name}"
            f" (attempt directory {where})"
        )
        if newer:
            reason += f"; attempt {job.attempt} stopped"
        end = await _late_end(session, item, reason)
        if end is None or end.outcome is not Outcome.SUCCEEDS:
            bound.info("late_success_of_one_rank", nodes=job.nodes)
            return
        # The attempt carried out is the job's current one: a newer one still starting or
        # running is superseded (every rank of it left over); an older one has nothing left.
        end = dataclasses.replace(end, leftover="superseded" if newer else None, ended=frozenset())
        moved = await end_attempt(
            session,
            AttemptRecord.from_row(job),
            end,
            expected=status,
            actor=self.actor,
            values={
                "vm_id": item.target.id,
                "gpu_indices": item.gpu_indices,
                "remote_pid": item.pid,
                "launch_token": item.run.token,
                "attempt_dir": kill.path or item.run.path,
                "completed_attempt": item.attempt,
            },
        )
        if not moved:
            return
        metrics.count_recovery("late_success")
        bound.warning("late_success_completed", superseded=job.attempt if newer else None)

    async def _fenced(self, item: _Open) -> str | None:
        """Why the attempt's watchdog fenced it off, if it did (None: not fenced, or the
        VM did not say)."""
        assert item.run is not None
        try:
            result = await self.transport.run(
                item.target, fenced_script(item.run), timeout=FENCED_READ_TIMEOUT_S
            )
        except TransportError:
            return None
        return parse_fenced(result.stdout).get((item.job_id, item.attempt))

    async def _note(self, session: AsyncSession, item: _Open, why: str) -> None:
        """Record in the job's history that its old attempt had fenced itself off (an event
        that changes no state: from and to are the job's current state)."""
        status = await session.scalar(select(Job.status).where(Job.id == item.job_id))
        if status is None:
            return
        vm = item.target.name
        await session.execute(
            insert(JobEvent).values(
                job_id=item.job_id,
                from_status=status,
                to_status=status,
                reason=f"fenced: attempt {item.attempt} on {vm} had stopped itself: {why}"[:500],
                actor=self.actor,
                attempt=item.attempt,
            )
        )
        log.info("leftover_was_fenced", job_id=item.job_id, attempt=item.attempt, vm=vm, why=why)
