"""The poller's progress-aware liveness (`scheduler.hang` decides, this applies).

- `record_progress`: the step each poll read, kept on the job with when it was first read,
  by the database's clock (in the sweep's inventory transaction).
- `load_watches`: at the sweep's start, each running attempt's timeouts and the ages of its
  launch and of its step (database clock), in the sweep's load transaction.
- `stalls`: after the polls landed, the attempts that are hung or stuck starting.
- `stop_stalled`: capture the attempt's diagnostics over SSH (no transaction), then fail
  the job in one short transaction (`attempts.end`, `attempts.finish.end_attempt`: the
  attempt becomes a leftover, its GPUs held until it is dead; the diagnostics row in the
  same transaction),
  then kill it like any leftover (TERM, `hang.STOP_GRACE_S`, KILL; `scheduler.kill`) and
  close the leftover once dead. The requeue manager retries the job from its newest
  checkpoint (`--resume auto`), counting the retry (`hung` and `startup_timeout` are
  COUNTED): a job that hangs every time ends `failed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, extract, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.db import Database
from scheduler.gpu_poller.state import Outcome
from scheduler.hang import STOP_GRACE_S, Stall, Watch, stall
from scheduler.history import ProgressRow
from scheduler.kill import kill_attempt
from scheduler.leftovers import close_leftover
from scheduler.logging import get_logger
from scheduler.models import Job, JobDiagnostics
from scheduler.remote.diagnostics import diagnostics_script, parse_diagnostics
from scheduler.states import JobStatus
from scheduler.transport import Transport, TransportError, VMTarget
from scheduler.verdicts import LiveJob

log = get_logger("gpu_poller")

ACTOR = "poller"
DIAGNOSTICS_TIMEOUT_S = 120.0
"""Most seconds the diagnostics command may take (each py-spy is bounded on the VM)."""

# Written only when the step or the attempt changed, so `progress_changed_at` is when the
# poller first read this step of this attempt.
_PROGRESS_SQL = text(
    """
UPDATE jobs SET progress_step = t.step, progress_attempt = t.attempt,
    progress_changed_at = now()
FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]), CAST(:steps AS int[]))
    AS t(id, attempt, step)
WHERE jobs.id = t.id AND jobs.attempt = t.attempt
  AND (jobs.progress_attempt IS DISTINCT FROM t.attempt
       OR jobs.progress_step IS DISTINCT FROM t.step)
"""
)


async def record_progress(session: AsyncSession, progress: Sequence[ProgressRow]) -> None:
    """Keep the step each poll read of each attempt (caller's transaction): one per
    attempt (ranks of one attempt report the same step; the highest is kept)."""
    steps: dict[tuple[int, int], int] = {}
    for row in progress:
        key = (row.job_id, row.attempt)
        steps[key] = max(row.step, steps.get(key, row.step))
    if not steps:
        return
    await session.execute(
        _PROGRESS_SQL,
        {
            "ids": [k[0] for k in steps],
            "attempts": [k[1] for k in steps],
            "steps": list(steps.values()),
        },
    )


def _age(column: Any) -> ColumnElement[Any]:
    """Seconds from `column` to the database's `now()`."""
    return extract("epoch", func.now() - column)


_TRAINS = text("(jobs.roles IS NULL OR jsonb_path_exists(jobs.roles, '$.roles.*.train'))")
"""Jobs with a training role: only they write progress.json (a group of services only
would be stuck starting for ever)."""


async def load_watches(session: AsyncSession) -> dict[tuple[int, int], Watch]:
    """Every running attempt with a liveness check on, by (job id, attempt)."""
    rows = await session.execute(
        select(
            Job.id,
            Job.attempt,
            Job.hang_timeout_s,
            Job.startup_timeout_s,
            _age(Job.running_at).label("running_s"),
            Job.progress_attempt,
            Job.progress_step,
            _age(Job.progress_changed_at).label("unchanged_s"),
        ).where(
            Job.status == JobStatus.RUNNING.value,
            (Job.hang_timeout_s > 0) | (Job.startup_timeout_s > 0),
            _TRAINS,
        )
    )
    watches = {}
    for row in rows:
        same = row.progress_attempt == row.attempt and row.progress_step is not None
        watches[(row.id, row.attempt)] = Watch(
            row.id,
            row.attempt,
            row.hang_timeout_s,
            row.startup_timeout_s,
            None if row.running_s is None else float(row.running_s),
            row.progress_step if same else None,
            float(row.unchanged_s) if same and row.unchanged_s is not None else None,
        )
    return watches


def stalls(
    outcomes: Sequence[Outcome], watches: dict[tuple[int, int], Watch]
) -> list[tuple[Outcome, LiveJob, Stall]]:
    """The rank-0 attempts these polls saw running that are hung or stuck starting (each
    `Stall` names the attempt's GPUs on the polled VM)."""
    found = []
    for outcome in outcomes:
        result = outcome.result
        if result is None:
            continue
        for job in outcome.vm.jobs:
            key = (job.id, job.attempt_number)
            watch = watches.get(key)
            state = result.jobs.get(key)
            if watch is None or job.rank != 0 or job.attempt is None:
                continue
            if state is None or state.state != "running" or job.id in outcome.finished:
                continue
            seen = state.progress.step if state.progress is not None else None
            uuids = [g.uuid for g in outcome.vm.gpus.values() if g.job_id == job.id]
            verdict = stall(watch, seen, result.loads, sorted(uuids))
            if verdict is not None:
                found.append((outcome, job, verdict))
    return found


async def stop_stalled(
    db: Database, transport: Transport, target: VMTarget, job: LiveJob, verdict: Stall
) -> bool:
    """Capture, fail, kill (see the module's docstring); whether the job moved."""
    run = job.attempt
    assert run is not None
    try:
        result = await transport.run(
            target,
            diagnostics_script(run, target.python, verdict.why, verdict.gpus),
            timeout=DIAGNOSTICS_TIMEOUT_S,
        )
        content = parse_diagnostics(result.stdout)
        if content is None:
            content = f"no diagnostics: the command printed none (exit {result.exit_status})"
    except TransportError as exc:
        content = f"no diagnostics: {exc}"
    async with db.transaction() as session:
        row = (
            await session.execute(
                select(*AttemptRecord.columns()).where(
                    Job.id == job.id,
                    Job.attempt == job.attempt_number,
                    Job.status == JobStatus.RUNNING.value,
                )
            )
        ).first()
        end = decide(None, RankEnd(How.STOPPED, verdict.why, job.rank, failure=verdict.reason))
        moved = row is not None and await end_attempt(
            session, AttemptRecord.from_row(row), end, expected=JobStatus.RUNNING, actor=ACTOR
        )
        if moved:
            await session.execute(
                insert(JobDiagnostics).values(
                    job_id=job.id,
                    attempt=job.attempt_number,
                    vm_name=target.name,
                    reason=verdict.why[:500],
                    content=content,
                )
            )
    if not moved:
        return False
    metrics.count_failure(verdict.reason.value)
    kill = await kill_attempt(transport, target, run, grace_s=STOP_GRACE_S, launched=True)
    if kill.dead:
        async with db.transaction() as session:
            await close_leftover(
                session, vm_id=target.id, job_id=job.id, attempt=job.attempt_number
            )
    log.warning(
        "job_stalled",
        job_id=job.id,
        vm=target.name,
        attempt=job.attempt_number,
        failure_reason=verdict.reason.value,
        reason=verdict.why,
        kill=kill.describe(),
        diagnostics_bytes=len(content),
    )
    return True
