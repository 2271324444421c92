"""Every job state change goes through `transition`: a guarded UPDATE plus an event row.

The dispatcher's hot path moves jobs `queued → starting` and `starting → running` in
statements of its own (`scheduler.claims`), one round trip per batch; they render the same
move with `move_set_sql` and `move_event_sql`, from the one definition `move_values`
that `transition` applies, so the two paths write the same rows
(tests/integration/test_transitions.py).

A job is created, listed and shown as data by the SQL of `scheduler.jobstore`, which the
command line runs without the ORM; `insert_job`, `list_jobs` and `job_to_dict` here are
that SQL and mapping over a session."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from scheduler import jobstore
from scheduler.db import SessionSql
from scheduler.errors import NotFound
from scheduler.jobstore import EVENT_COLUMNS, JOB_FIELDS, NewJob, job_dict
from scheduler.jobstore import JobSpec as JobSpec  # where callers have always found it
from scheduler.models import Job, JobEvent, JobNode
from scheduler.retry import is_machine_fault
from scheduler.states import STATE_TIMESTAMP, JobStatus, check_move
from scheduler.validate import INT4, UnreadableJson


class _Clock:
    """The statement's clock in `move_values`: `now()` in `transition`, whatever clock a
    fast path's statement uses when rendered (`move_set_sql`)."""

    def __repr__(self) -> str:
        return "CLOCK"


CLOCK = _Clock()


def move_values(sources: Sequence[JobStatus], to: JobStatus) -> dict[str, Any]:
    """The columns EVERY move from one of `sources` to `to` sets, whatever else the mover
    sets: the state, the state's timestamp and `updated_at` (`CLOCK`), and the retry
    decision cleared (a decision belongs to one failure; a move starts or ends one). A move
    the state machine forbids raises `IllegalMove`.

    The one definition of a move's bookkeeping: `transition` applies it, and the claim and
    running statements of `scheduler.claims` render it with `move_set_sql`."""
    for source in sources:
        check_move(source, to)
    values: dict[str, Any] = {
        "status": to.value,
        STATE_TIMESTAMP[to]: CLOCK,
        "updated_at": CLOCK,
        "retry_decision": None,
    }
    if JobStatus.FAILED in sources:
        # A retry time belongs to one failure; leaving `failed` (by any path) ends it.
        values["next_attempt_at"] = None
    return values


def move_set_sql(src: JobStatus, to: JobStatus, *, clock: str = "now()") -> str:
    """`move_values(src → to)` as the SET list of a hand-written UPDATE of `jobs`, with
    `clock` for the timestamps. Raises `IllegalMove` for a forbidden move, so a statement
    rendered at import cannot drift from the state machine."""
    return ", ".join(
        f"{column} = {_sql_value(value, clock)}" for column, value in move_values([src], to).items()
    )


def move_event_sql(
    src: JobStatus,
    to: JobStatus,
    *,
    rows: str,
    job_id: str,
    reason: str,
    actor: str,
    attempt: str,
) -> str:
    """The `INSERT … SELECT` of a move's event rows, one per row of `rows` (a CTE, a
    subquery), each column given as SQL over those rows or as a bind parameter."""
    check_move(src, to)
    picked = ", ".join(
        (job_id, _sql_value(src.value, ""), _sql_value(to.value, ""), reason, actor, attempt)
    )
    return f"INSERT INTO job_events ({', '.join(EVENT_COLUMNS)}) SELECT {picked} FROM {rows}"


_EVENT_SQL: dict[tuple[JobStatus, JobStatus], Any] = {}


def _event_statement(src: JobStatus, to: JobStatus) -> Any:
    """`transition`'s event insert: `move_event_sql` over a one-row source, cached."""
    key = (src, to)
    if key not in _EVENT_SQL:
        _EVENT_SQL[key] = text(
            move_event_sql(
                src,
                to,
                rows="(SELECT 1) AS one",
                job_id=":job_id",
                reason=":reason",
                actor=":actor",
                attempt=":attempt",
            )
        )
    return _EVENT_SQL[key]


def _sql_value(value: Any, clock: str) -> str:
    """A `move_values` value as SQL text: the clock, NULL, or a state name."""
    if value is CLOCK:
        return clock
    if value is None:
        return "NULL"
    if isinstance(value, str) and value in {s.value for s in JobStatus}:
        return f"'{value}'"
    raise TypeError(f"not a move value: {value!r}")


async def transition(
    session: AsyncSession,
    job_id: int,
    *,
    expected: JobStatus | Iterable[JobStatus],
    to: JobStatus,
    reason: str | None,
    actor: str,
    values: Mapping[str, Any] | None = None,
    attempt: int | None = None,
) -> bool:
    """Move job `job_id` from one of `expected` to `to`, inside the caller's transaction.

    The UPDATE is guarded with `status IN (:expected)`, so when two movers race exactly one
    wins; the loser gets False and must do nothing further. With `attempt`, it is guarded
    by the attempt too: news about an old attempt cannot move the job's next one. `values`
    sets more columns in the same statement. A move the state machine forbids raises
    `IllegalMove`. A move into `failed` for a machine fault (`retry.is_machine_fault`)
    counts one more in `machine_faults`.
    """
    sources = [JobStatus(expected)] if isinstance(expected, str) else list(expected)
    changes: dict[str, Any] = {
        column: func.now() if value is CLOCK else value
        for column, value in move_values(sources, to).items()
    }
    changes.update(values or {})
    if to == JobStatus.FAILED and _is_machine_fault(changes):
        # Saturating: a count written at the integer limit must not fail the mover's
        # transaction (a poll, a requeue tick) with an overflow.
        changes["machine_faults"] = func.least(Job.machine_faults, INT4[1] - 1) + 1
    if len(sources) == 1:
        src = sources[0]
    else:
        # Several possible sources: lock the row to learn which one the event records.
        now = await session.scalar(select(Job.status).where(Job.id == job_id).with_for_update())
        if now not in {source.value for source in sources}:
            return False
        src = JobStatus(now)
    guard = [Job.id == job_id, Job.status == src.value]
    if attempt is not None:
        guard.append(Job.attempt == attempt)
    row = (
        await session.execute(
            update(Job)
            .where(*guard)
            .values(**changes)
            .returning(Job.attempt)
            .execution_options(synchronize_session=False)
        )
    ).first()
    if row is None:
        return False
    event = {"job_id": job_id, "reason": reason, "actor": actor, "attempt": row.attempt}
    if src in WAITING and to in WAITING:
        repeat = {"job_id": job_id, "attempt": row.attempt, "reason": reason}
        repeat.update(src=src.value, to=to.value)
        if (await session.execute(_REPEAT_SQL, repeat)).first() is not None:
            return True
    await session.execute(_event_statement(src, to), event)
    return True


WAITING = frozenset({JobStatus.QUEUED, JobStatus.PENDING})
"""The states of a job waiting for GPUs: moves between them repeat (the dispatcher parks
the job, the requeue manager wakes it) and are counted, not appended (`_REPEAT_SQL`)."""

_WAITING_SQL = ", ".join(f"'{state.value}'" for state in sorted(WAITING))
_REPEAT_SQL = text(
    f"""
UPDATE job_events SET count = count + 1, last_at = now()
WHERE id = (
    SELECT e.id FROM job_events e
    WHERE e.job_id = :job_id AND e.attempt = :attempt
      AND e.from_status = :src AND e.to_status = :to AND e.reason IS NOT DISTINCT FROM :reason
      AND e.id > (
          SELECT coalesce(max(other.id), 0) FROM job_events other
          WHERE other.job_id = :job_id
            AND NOT (other.from_status IN ({_WAITING_SQL})
                     AND other.to_status IN ({_WAITING_SQL}))
      )
    ORDER BY e.id DESC LIMIT 1
)
RETURNING id
"""
)
"""Count one more of a waiting move in its row of the current waiting spell (the same
move, reason and attempt, with nothing but waiting moves since); no row: none yet."""


def _is_machine_fault(changes: Mapping[str, Any]) -> bool:
    """Whether the failure a move records (`failure_reason`, `exit_code` among the values
    it sets) is the VM's fault; values given as SQL expressions are not."""
    reason, exit_code = changes.get("failure_reason"), changes.get("exit_code")
    if not isinstance(reason, str) or not isinstance(exit_code, int | None):
        return False
    return is_machine_fault(reason, exit_code)


async def insert_job(session: AsyncSession, spec: JobSpec, *, actor: str) -> NewJob:
    """Validate and insert a `queued` job with its first event (`jobstore.insert_job`, the
    statement `job submit` runs too)."""
    return await jobstore.insert_job(SessionSql(session), spec, actor=actor)


async def get_job(
    session: AsyncSession, job_id: int, *, with_events: bool = False, with_ranks: bool = False
) -> Job:
    """The job with id `job_id`, or `NotFound`; `with_ranks` loads its `job_nodes` rows."""
    query = select(Job).where(Job.id == job_id).options(selectinload(Job.vm))
    if with_events:
        query = query.options(selectinload(Job.events))
    if with_ranks:
        query = query.options(selectinload(Job.ranks).selectinload(JobNode.vm))
        query = query.options(selectinload(Job.ports))
    job = await session.scalar(query)
    if job is None:
        raise NotFound(f"no job with id {job_id}")
    return job


async def list_jobs(
    session: AsyncSession,
    *,
    status: JobStatus | Collection[JobStatus] | None = None,
    limit: int = 100,
    name: str | None = None,
) -> list[dict[str, Any]]:
    """The newest jobs first as plain data (`job_to_dict`'s fields), optionally only those
    in `status` (one or several) and those whose name contains `name` (case-insensitive,
    taken literally): `jobstore.list_jobs`, the query `job list` runs too."""
    return await jobstore.list_jobs(SessionSql(session), status=status, limit=limit, name=name)


async def mark_published(session: AsyncSession, job_id: int) -> None:
    """Record that the job id was stored by the stream just now."""
    await jobstore.mark_published(SessionSql(session), job_id)


async def show_job(
    session: AsyncSession,
    job_id: int,
    *,
    events_limit: int | None = None,
    events_before: int | None = None,
) -> dict[str, Any]:
    """Everything `job show` (and any other viewer) shows of one job, as plain data: the
    row, its event history and every node it runs on (`NotFound` if no such job).

    `events_limit` keeps the newest events only (oldest first, as always), those before
    event id `events_before` if given; `events_older` says how many older ones were left
    out (ask again with `events_before` = the first event's id)."""
    job = await get_job(session, job_id, with_ranks=True)
    data = job_to_dict(job, ranks=True)
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if events_before is not None:
        query = query.where(JobEvent.id < events_before)
    query = query.order_by(JobEvent.id.desc())
    if events_limit is not None:
        query = query.limit(events_limit)
    events = list(reversed((await session.scalars(query)).all()))
    older = 0
    if events and events_limit is not None and len(events) == events_limit:
        older = int(
            await session.scalar(
                select(func.count())
                .select_from(JobEvent)
                .where(JobEvent.job_id == job_id, JobEvent.id < events[0].id)
            )
            or 0
        )
    data["events"] = [event_to_dict(e) for e in events]
    data["events_older"] = older
    return data


def event_to_dict(event: JobEvent) -> dict[str, Any]:
    """One event as `job show --json` prints it; `count` > 1 for a waiting move repeated
    (the last one at `last_at`)."""
    return {
        "id": event.id,
        "at": event.created_at,
        "from": event.from_status,
        "to": event.to_status,
        "reason": event.reason,
        "actor": event.actor,
        "attempt": event.attempt,
        "count": event.count,
        "last_at": event.last_at,
    }


def rank_state(job_status: str, exit_code: int | None, pid: int | None) -> str:
    """What one node of a job is doing, from what the scheduler recorded: `exited` (with
    its exit code), `running` or `starting` while the job is live, else the job's state
    (a rank that recorded no exit was killed with the rest)."""
    if exit_code is not None:
        return "exited"
    if job_status in (JobStatus.STARTING.value, JobStatus.RUNNING.value):
        return "running" if pid is not None else "starting"
    return job_status


def ranks_to_dicts(job: Job) -> list[dict[str, Any]]:
    """Every node of the job's latest claimed attempt (`job_nodes`, one per VM, rank 0
    first, a single-node job's one included): its VM, GPUs, pid, directory and state. A job
    that was never claimed has none; one last claimed before every claim wrote `job_nodes`
    (migration 0013) shows its row, rank 0's copy. `job.ranks` must be loaded
    (`get_job(with_ranks=True)`)."""
    rows: list[Any] = list(job.ranks)
    if not rows and job.attempt > 0 and job.vm_id is not None:
        rows = [job]
    return [
        {
            "rank": getattr(row, "rank", 0),
            "vm": row.vm.name if row.vm is not None else None,
            "gpu_indices": row.gpu_indices,
            "gpu_uuids": row.gpu_uuids,
            "pid": row.remote_pid,
            "attempt": row.attempt,
            "attempt_dir": row.attempt_dir,
            "state": rank_state(job.status, row.exit_code, row.remote_pid),
            "exit_code": row.exit_code,
        }
        for row in rows
    ]


def roles_to_dicts(job: Job) -> list[dict[str, Any]]:
    """A job group's roles (empty for a job of one training role), one entry per rank of
    each (`rank`; `node` is the layout node running it): its VM (the group's, or its
    node's for a group over several VMs), GPUs (its slice of its VM's claim), ports this
    attempt got (on its rank 0's VM), the pid of the
    group's supervisor, its restarts in place recorded so far and a state from the job's
    (`control.job_details` puts in each role's own pid, state, exit code and restarts,
    read from the VM). `job.ports` and `job.ranks`
    must be loaded."""
    from scheduler.attempts.shape import JobShape
    from scheduler.remote.restarts import recorded_restarts

    shape = JobShape.of_row(job)
    group = shape.spec
    if group is None:  # a job of one training role, or roles that do not read back
        return []
    claimed = job.attempt > 0 and job.vm_id is not None and job.gpu_indices is not None
    ports = {(p.role, p.name): p.port for p in job.ports if p.attempt == job.attempt}
    # A group over several VMs: each rank of a role on its node's VM, sliced from that
    # node's GPUs.
    nodes: list[Any] = [r for r in job.ranks if r.attempt == job.attempt] or [job]
    spread = len(nodes) == shape.nodes
    nodes_of = {r.name: shape.ranks_of(r.name) if spread else (0,) * r.nodes for r in group.roles}
    starts = [0] * len(nodes)
    out = []
    for role in group.roles:
        for rank, at in enumerate(nodes_of[role.name]):
            row = nodes[at]
            indices, uuids = list(row.gpu_indices or []), list(row.gpu_uuids or [])
            take = slice(starts[at], starts[at] + role.gpus)
            starts[at] += role.gpus
            out.append(
                {
                    "name": role.name,
                    "rank": rank,
                    "node": at,
                    "primary": role.primary,
                    "command": list(role.command) if role.command is not None else None,
                    "train": role.train is not None,
                    "depends_on": list(role.depends_on),
                    "vm": row.vm.name if claimed and row.vm is not None else None,
                    "gpu_indices": indices[take] if claimed else [],
                    "gpu_uuids": uuids[take] if claimed else [],
                    # A role's ports are on its rank 0's VM.
                    "ports": {name: ports.get((role.name, name)) for name in role.ports},
                    "supervisor_pid": row.remote_pid,
                    "pid": None,
                    "exit_code": None,
                    "restart": role.restart,
                    "max_restarts": role.max_restarts,
                    # Restarts in place the poller recorded (the VM's own count, read by
                    # `control.job_details`, may be newer).
                    "restarts": recorded_restarts(
                        getattr(row, "role_restarts", None), job.attempt
                    ).get(role.name, 0),
                    "state": rank_state(job.status, row.exit_code, row.remote_pid)
                    if claimed
                    else job.status,
                }
            )
    return out


def job_to_dict(job: Job, *, events: bool = False, ranks: bool = False) -> dict[str, Any]:
    """A job as plain data, for `--json` and for display (`jobstore.job_dict`, the mapping
    of `job list`); `ranks` adds its nodes (`ranks_to_dicts`), `events` its history."""
    row = {key: getattr(job, column) for key, column in JOB_FIELDS if column is not None}
    # The names of an object's keys only: a row whose env is anything else (written by
    # hand) has none, and its values are never shown.
    row["env_keys"] = (
        [key for key in job.env if isinstance(key, str)] if isinstance(job.env, dict) else []
    )
    row["vm"] = job.vm.name if job.vm is not None else None
    row["gpus_per_node"] = job.roles  # read into each rank's GPUs by `job_dict`
    roles = job.roles
    row["group"] = isinstance(roles, dict) or (
        isinstance(roles, UnreadableJson) and roles.kind == "object"
    )
    data = job_dict(row)
    if ranks:
        data["ranks"] = ranks_to_dicts(job)
        data["roles"] = roles_to_dicts(job)
    if events:
        data["events"] = [event_to_dict(e) for e in job.events]
    return data
