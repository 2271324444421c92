"""What a launch learns and records in the caller's transaction: the launched attempts
moved `starting → running` in one statement with their event rows and rank 0's pid and
directory (`mark_running_batch`), each rank's pid and directory (`record_ranks`), and a job
group's ports (`record_group_ports`). Where each rank runs (its `job_nodes` row: VM, GPUs,
attempt) is written by the claim alone (`claims.statements.TAKE_SQL`); these only fill in
what the launch learned."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from scheduler.jobs import move_event_sql, move_set_sql
from scheduler.models import JobNode, JobPort
from scheduler.states import JobStatus

_RUNNING_MOVE = move_set_sql(JobStatus.STARTING, JobStatus.RUNNING)
_RUNNING_EVENT = move_event_sql(
    JobStatus.STARTING,
    JobStatus.RUNNING,
    rows="moved",
    job_id="id",
    reason="reason",
    actor=":actor",
    attempt="attempt",
)
MARK_RUNNING_BATCH_SQL = text(
    f"""
WITH launched AS (
    SELECT * FROM unnest(CAST(:job_ids AS bigint[]), CAST(:attempts AS integer[]),
                         CAST(:pids AS integer[]), CAST(:reasons AS text[]),
                         CAST(:dirs AS text[]))
                  AS l(job_id, attempt, pid, reason, dir)
), locked AS MATERIALIZED (
    -- Job rows locked in id order, as every transaction that moves several jobs should.
    SELECT j.id FROM jobs j WHERE j.id IN (SELECT job_id FROM launched)
    ORDER BY j.id FOR UPDATE
), moved AS (
    -- `transition(starting → running)` for each launched attempt (see _RUNNING_MOVE).
    UPDATE jobs SET {_RUNNING_MOVE},
                    remote_pid = l.pid, attempt_dir = l.dir, lease_expires_at = NULL
    FROM launched l
    WHERE jobs.id = l.job_id AND jobs.id IN (SELECT id FROM locked)
      AND jobs.status = 'starting' AND jobs.attempt = l.attempt
    RETURNING jobs.id, jobs.attempt, jobs.queued_at, jobs.starting_at, jobs.submitted_at,
              jobs.running_at, l.reason
), node AS (
    -- Rank 0's pid and directory on its `job_nodes` row too (the job row mirrors them).
    UPDATE job_nodes SET remote_pid = l.pid, attempt_dir = l.dir
    FROM launched l
    WHERE job_nodes.job_id = l.job_id AND job_nodes.rank = 0
      AND job_nodes.attempt = l.attempt AND job_nodes.job_id IN (SELECT id FROM moved)
), event AS (
    {_RUNNING_EVENT}
)
SELECT id, attempt, queued_at, starting_at, submitted_at, running_at FROM moved
"""
)


@dataclass(frozen=True)
class Running:
    """A job just moved `starting → running`, with the timestamps metrics want."""

    attempt: int
    queued_at: datetime | None
    starting_at: datetime | None
    submitted_at: datetime | None
    running_at: datetime | None


@dataclass(frozen=True)
class Launched:
    """An attempt the VM says it started: the pid of its process-group leader, and the
    absolute directory the launch reported (None if it reported none)."""

    job_id: int
    attempt: int
    pid: int
    reason: str
    attempt_dir: str | None = None


async def mark_running_batch(
    conn: AsyncConnection, launched: Sequence[Launched], *, actor: str
) -> dict[int, Running]:
    """`transition(starting → running)` for each launched attempt, in ONE statement with
    their event rows (caller's transaction); returns the moved jobs by id.

    A job missing from the result is no longer `starting` at that attempt (cancelled, or
    its lease expired and it was claimed again): the caller must not let that attempt run.
    """
    if not launched:
        return {}
    rows = await conn.execute(
        MARK_RUNNING_BATCH_SQL,
        {
            "job_ids": [x.job_id for x in launched],
            "attempts": [x.attempt for x in launched],
            "pids": [x.pid for x in launched],
            "reasons": [x.reason for x in launched],
            "dirs": [x.attempt_dir for x in launched],
            "actor": actor,
        },
    )
    return {row.id: Running(*row[1:]) for row in rows}


async def record_ranks(
    conn: AsyncConnection, job_id: int, attempt: int, ranks: Sequence[tuple[int, int, str | None]]
) -> None:
    """Record each launched rank's (rank, pid, absolute directory) of a multi-node attempt
    on the rows its claim wrote (caller's transaction); rows of another attempt are left
    alone, and no row is added."""
    for rank, pid, path in ranks:
        await conn.execute(
            update(JobNode)
            .where(JobNode.job_id == job_id, JobNode.rank == rank, JobNode.attempt == attempt)
            .values(remote_pid=pid, attempt_dir=path)
        )


class PortCollision(Exception):
    """A port a VM said was free is recorded for another live attempt there: ask again."""


async def record_group_ports(
    conn: AsyncConnection,
    job_id: int,
    attempt: int,
    ports: Sequence[tuple[int, str, str, int]],
) -> None:
    """Record the (VM, role, name, port) a job group's attempt got on each of its VMs
    (caller's transaction), replacing the job's earlier rows; `PortCollision` (roll back)
    when another attempt holds one of them on that VM."""
    await conn.execute(delete(JobPort).where(JobPort.job_id == job_id))
    if not ports:
        return
    rows = [
        {"vm_id": vm, "port": port, "job_id": job_id, "attempt": attempt, "role": r, "name": n}
        for vm, r, n, port in ports
    ]
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    taken = await conn.execute(
        pg_insert(JobPort).values(rows).on_conflict_do_nothing().returning(JobPort.port)
    )
    if len(taken.all()) != len(rows):
        raise PortCollision(f"a port of job {job_id} is held by another attempt on its VM")
