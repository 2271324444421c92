"""How the poller records a job group's restarts in place: each role with `restart:
on-failure` that its VM's supervisor restarted (counted in the attempt's `roles.json`, read
by the poll, `remote.restarts`) gets one event per restart in the job's history, once.

What the file says is checked against the job's own roles before anything is written (a
role of the job that may restart, on this rank's VM, at most its `max_restarts`): the file
is the job's to write (docs/invariants.md, invariant 9). What has been recorded is kept in
`job_nodes.role_restarts` (`{"attempt": N, "roles": {role: restarts}}`), written with a
guard on its old value in the transaction that adds the events, so two pollers never
record a restart twice; the poller also remembers it, so a sweep that sees nothing new
opens no transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler.attempts.shape import JobShape
from scheduler.db import Database
from scheduler.gpu_poller.state import Outcome
from scheduler.logging import get_logger
from scheduler.models import Job, JobEvent, JobNode
from scheduler.remote.restarts import RoleRestarts, recorded_restarts
from scheduler.verdicts import LiveJob

log = get_logger("gpu_poller")

ACTOR = "poller"

KNOWN_MAX = 10_000
"""Most ranks whose recorded restarts the poller remembers."""
Key = tuple[int, int, int]
"""(job id, attempt, rank)."""


async def record_restarts(
    db: Database, outcomes: Sequence[Outcome], known: dict[Key, dict[str, int]]
) -> int:
    """Record the restarts in place these polls saw that are not recorded yet (`known`:
    what this poller recorded or found recorded, updated here); how many events were
    added. One short transaction per rank with news."""
    added = 0
    for outcome in outcomes:
        if outcome.result is None or not outcome.result.restarts:
            continue
        for job in outcome.vm.jobs:
            seen = outcome.result.restarts.get((job.id, job.attempt_number))
            key = (job.id, job.attempt_number, job.rank)
            if not seen or all(s.count <= known.get(key, {}).get(n, 0) for n, s in seen.items()):
                continue
            async with db.transaction() as session:
                added += await _record(session, job, seen, known)
    if len(known) > KNOWN_MAX:
        known.clear()  # only saves transactions: what is recorded is read again when needed
    return added


async def _record(
    session: AsyncSession, job: LiveJob, seen: dict[str, RoleRestarts], known: dict[Key, Any]
) -> int:
    """The events for `job`'s rank's new restarts (caller's transaction); how many."""
    row = (
        await session.execute(
            select(Job.status, Job.nodes, Job.gpus_requested, Job.roles, JobNode.role_restarts)
            .join(JobNode, JobNode.job_id == Job.id)
            .where(
                Job.id == job.id,
                Job.attempt == job.attempt_number,
                JobNode.rank == job.rank,
                JobNode.attempt == job.attempt_number,
            )
        )
    ).first()
    if row is None:
        return 0  # moved on since the probe
    limits = _restart_limits(JobShape.of_row(row), job.rank)
    recorded = recorded_restarts(row.role_restarts, job.attempt_number)
    counts = dict(recorded)
    events = []
    for name, restarts in sorted(seen.items()):
        limit = limits.get(name)
        if limit is None or restarts.count > limit:
            continue  # not a role of this rank that may restart that often: not the supervisor's
        for number in range(recorded.get(name, 0) + 1, restarts.count + 1):
            why = f": {restarts.why()}" if number == restarts.count else ""
            events.append(f"role {name} restarted in place ({number} of {limit}){why}")
        counts[name] = max(counts.get(name, 0), restarts.count)
    known[(job.id, job.attempt_number, job.rank)] = counts
    if not events:
        return 0
    moved = await session.execute(
        update(JobNode)
        .where(
            JobNode.job_id == job.id,
            JobNode.rank == job.rank,
            JobNode.attempt == job.attempt_number,
            JobNode.role_restarts == row.role_restarts,
        )
        .values(role_restarts={"attempt": job.attempt_number, "roles": counts})
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        known.pop((job.id, job.attempt_number, job.rank), None)  # another poller: read again
        return 0
    await session.execute(
        insert(JobEvent),
        [
            {
                "job_id": job.id,
                "from_status": row.status,
                "to_status": row.status,
                "reason": reason,
                "actor": ACTOR,
                "attempt": job.attempt_number,
            }
            for reason in events
        ],
    )
    log.info("role_restarted", job_id=job.id, attempt=job.attempt_number, restarts=counts)
    return len(events)


def _restart_limits(shape: JobShape, rank: int) -> dict[str, int]:
    """The `max_restarts` of each role of the job (its shape, read from its stored
    `roles`) that may restart in place and whose one rank runs on layout node `rank`; {}
    for a job that is no group, or whose roles do not read back."""
    from scheduler.jobspec import RESTART_ON_FAILURE

    if shape.spec is None:
        return {}
    return {
        r.name: r.max_restarts
        for r in shape.spec.roles
        if r.restart == RESTART_ON_FAILURE and shape.ranks_of(r.name)[:1] == (rank,)
    }
