"""Every job state change goes through `transition`: a guarded UPDATE plus an event row.

The dispatcher's hot path moves jobs `queued → starting` and `starting → running` in
statements of its own (`scheduler.claims`), one round trip per batch; they render the same
move with `move_set_sql` and `move_event_sql`, from the one definition `move_values`
that `transition` applies, so the two paths write the same rows
(tests/integration/test_transitions.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from scheduler.errors import BadInput, NotFound
from scheduler.models import Job, JobEvent, JobNode
from scheduler.retry import is_machine_fault
from scheduler.states import STATE_TIMESTAMP, JobStatus, check_move
from scheduler.validate import (
    MAX_GPUS,
    MAX_NODES,
    MAX_RETRIES,
    check_int,
    check_text,
    extra_args_problem,
)


class _Clock:
    """The statement's clock in `move_values`: `now()` in `transition`, whatever clock a
    fast path's statement uses when rendered (`move_set_sql`)."""

    def __repr__(self) -> str:
        return "CLOCK"


CLOCK = _Clock()

EVENT_COLUMNS = ("job_id", "from_status", "to_status", "reason", "actor", "attempt")
"""The columns of a move's `job_events` row, in the order `move_event_sql` fills them."""


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
        changes["machine_faults"] = Job.machine_faults + 1
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
    await session.execute(
        _event_statement(src, to),
        {"job_id": job_id, "reason": reason, "actor": actor, "attempt": row.attempt},
    )
    return True


def _is_machine_fault(changes: Mapping[str, Any]) -> bool:
    """Whether the failure a move records (`failure_reason`, `exit_code` among the values
    it sets) is the VM's fault; values given as SQL expressions are not."""
    reason, exit_code = changes.get("failure_reason"), changes.get("exit_code")
    if not isinstance(reason, str) or not isinstance(exit_code, int | None):
        return False
    return is_machine_fault(reason, exit_code)


async def create_job(session: AsyncSession, *, actor: str, **fields: Any) -> Job:
    """Insert a job as `queued` with its first event; returns the flushed row."""
    job = Job(status=JobStatus.QUEUED.value, **fields)
    session.add(job)
    await session.flush()
    job.queued_at = job.submitted_at
    session.add(
        JobEvent(
            job_id=job.id, from_status=None, to_status="queued", reason="submitted", actor=actor
        )
    )
    await session.flush()
    return job


@dataclass(frozen=True)
class JobSpec:
    """What a user gives to submit a job."""

    model: str
    dataset: str
    reward_functions: tuple[str, ...]
    gpus: int = 1
    """GPUs on each node."""
    nodes: int = 1
    """VMs the job spans (`--nodes`), `gpus` on each."""
    max_retries: int = 3
    priority: int = 0
    name: str | None = None
    extra_args: tuple[str, ...] = ()
    output_dir: str | None = None
    """Where train_grpo.py writes on the VM; None means `remote.default_output_dir`."""
    env: tuple[tuple[str, str], ...] = ()
    """`--env KEY=VALUE` pairs for the job's environment."""
    roles: dict[str, Any] | None = None
    """A job group's roles (`jobspec.GroupSpec.to_data`); None for one training role."""

    def validate(self) -> None:
        """Raise `BadInput` for a job that could never run or that the schema cannot hold
        (limits in `scheduler.validate`, read from the columns)."""
        validate_job_env(self.env)
        check_text(self.model, "--model", column=Job.model)
        check_text(self.dataset, "--dataset", column=Job.dataset)
        if not self.reward_functions:
            raise BadInput("--reward-function must not be empty")
        for reward in self.reward_functions:
            check_text(reward, "--reward-function", column=Job.reward_function)
        if any("," in r for r in self.reward_functions):
            raise BadInput("give several reward functions as repeated --reward-function flags")
        check_text(",".join(self.reward_functions), "--reward-function", column=Job.reward_function)
        if self.gpus < 1:
            raise BadInput(f"--gpus must be at least 1, not {self.gpus}")
        check_int(self.gpus, "--gpus", column=Job.gpus_requested, lo=1, hi=MAX_GPUS)
        check_int(self.nodes, "--nodes", column=Job.nodes, lo=1, hi=MAX_NODES)
        if self.max_retries < 0:
            raise BadInput(f"--max-retries must not be negative, not {self.max_retries}")
        check_int(self.max_retries, "--max-retries", column=Job.max_retries, lo=0, hi=MAX_RETRIES)
        check_int(self.priority, "--priority", column=Job.priority)
        if self.name is not None:
            check_text(self.name, "--name", column=Job.name)
        if self.output_dir is not None:
            check_text(self.output_dir, "--output-dir", column=Job.output_dir)
        problem = extra_args_problem(self.extra_args)
        if problem:
            raise BadInput(problem)


async def insert_job(session: AsyncSession, spec: JobSpec, *, actor: str) -> Job:
    """Validate and insert a `queued` job with its first event."""
    spec.validate()
    return await create_job(
        session,
        actor=actor,
        name=spec.name,
        model=spec.model,
        dataset=spec.dataset,
        reward_function=",".join(spec.reward_functions),
        gpus_requested=spec.gpus,
        nodes=spec.nodes,
        max_retries=spec.max_retries,
        priority=spec.priority,
        extra_args=list(spec.extra_args),
        output_dir=spec.output_dir,
        env=dict(spec.env),
        roles=spec.roles,
    )


MAX_ENV_VALUE = 32768


def validate_job_env(env: Iterable[tuple[str, str]]) -> None:
    """Raise `BadInput` for a variable a job may not set, or a value that cannot be
    stored in the one-line-per-variable `job.env` (the value itself is never quoted)."""
    from scheduler.remote import env_key_problem

    seen: set[str] = set()
    for key, value in env:
        problem = env_key_problem(key)
        if problem:
            raise BadInput(f"--env {problem}")
        if key in seen:
            raise BadInput(f"--env {key} given twice")
        seen.add(key)
        if "\n" in value or "\r" in value or "\0" in value:
            raise BadInput(f"--env {key}: the value must be one line")
        if len(value) > MAX_ENV_VALUE:
            raise BadInput(f"--env {key}: the value is longer than {MAX_ENV_VALUE} characters")


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
) -> list[Job]:
    """The newest jobs first, optionally only those in `status` (one or several) and those
    whose name contains `name` (case-insensitive, taken literally)."""
    query = select(Job).options(selectinload(Job.vm)).order_by(Job.id.desc()).limit(limit)
    if isinstance(status, JobStatus):
        query = query.where(Job.status == status.value)
    elif status is not None:
        query = query.where(Job.status.in_([s.value for s in status]))
    if name:
        query = query.where(Job.name.icontains(name, autoescape=True))
    return list(await session.scalars(query))


async def mark_published(session: AsyncSession, job_id: int) -> None:
    """Record that the job id was stored by the stream just now."""
    await session.execute(update(Job).where(Job.id == job_id).values(published_at=func.now()))


async def show_job(session: AsyncSession, job_id: int) -> dict[str, Any]:
    """Everything `job show` (and any other viewer) shows of one job, as plain data: the
    row, its event history and every node it runs on (`NotFound` if no such job)."""
    job = await get_job(session, job_id, with_events=True, with_ranks=True)
    return job_to_dict(job, events=True, ranks=True)


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
    """Every node of the job's current (or completing) attempt, rank 0 first: its VM, GPUs,
    pid, directory and state. A single-node job's one node is its row; a job that was
    never claimed has none. `job.ranks` must be loaded (`get_job(with_ranks=True)`)."""
    if job.nodes > 1:
        rows: list[Any] = list(job.ranks)
    elif job.attempt > 0 and job.vm_id is not None:
        rows = [job]
    else:
        return []
    single = job.nodes == 1
    return [
        {
            "rank": 0 if single else row.rank,
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
    """A job group's roles (empty for a job of one training role): each one's VM (the
    group's), GPUs (its slice of the claim), ports this attempt got, the pid of the
    group's supervisor and a state from the job's (`control.job_details` puts in each
    role's own pid, state and exit code, read from the VM). `job.ports` must be loaded."""
    from scheduler.errors import BadInput
    from scheduler.jobspec import parse_data

    if job.roles is None:
        return []
    try:
        group = parse_data(job.roles)
    except BadInput:
        return []
    claimed = job.attempt > 0 and job.vm_id is not None and job.gpu_indices is not None
    indices = list(job.gpu_indices or [])
    uuids = list(job.gpu_uuids or [])
    ports = {(p.role, p.name): p.port for p in job.ports if p.attempt == job.attempt}
    out, start = [], 0
    for role in group.roles:
        take = slice(start, start + role.gpus)
        start += role.gpus
        out.append(
            {
                "name": role.name,
                "primary": role.primary,
                "command": list(role.command) if role.command is not None else None,
                "train": role.train is not None,
                "depends_on": list(role.depends_on),
                "vm": job.vm.name if claimed and job.vm is not None else None,
                "gpu_indices": indices[take] if claimed else [],
                "gpu_uuids": uuids[take] if claimed else [],
                "ports": {name: ports.get((role.name, name)) for name in role.ports},
                "supervisor_pid": job.remote_pid,
                "pid": None,
                "exit_code": None,
                "state": rank_state(job.status, job.exit_code, job.remote_pid)
                if claimed
                else job.status,
            }
        )
    return out


def job_to_dict(job: Job, *, events: bool = False, ranks: bool = False) -> dict[str, Any]:
    """A job as plain data, for `--json` and for display; `ranks` adds its nodes
    (`ranks_to_dicts`)."""
    data: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "status": job.status,
        "status_reason": job.status_reason,
        "model": job.model,
        "dataset": job.dataset,
        "reward_function": job.reward_function,
        "extra_args": job.extra_args,
        # The names only: the values may be secrets (tokens, keys).
        "env_keys": sorted(job.env or {}),
        "gpus": job.gpus_requested,
        "nodes": job.nodes,
        "priority": job.priority,
        "attempt": job.attempt,
        "retry_count": job.retry_count,
        "max_retries": job.max_retries,
        "failure_reason": job.failure_reason,
        "exit_code": job.exit_code,
        "vm": job.vm.name if job.vm is not None else None,
        "gpu_indices": job.gpu_indices,
        "gpu_uuids": job.gpu_uuids,
        "remote_pid": job.remote_pid,
        "output_dir": job.output_dir,
        "attempt_dir": job.attempt_dir,
        "completed_attempt": job.completed_attempt,
        "next_attempt_at": job.next_attempt_at,
        "retry_decision": job.retry_decision,
        "machine_faults": job.machine_faults,
        "submitted_at": job.submitted_at,
        "starting_at": job.starting_at,
        "running_at": job.running_at,
        "finished_at": job.finished_at,
    }
    if ranks:
        data["ranks"] = ranks_to_dicts(job)
        data["roles"] = roles_to_dicts(job)
    if events:
        data["events"] = [
            {
                "at": e.created_at,
                "from": e.from_status,
                "to": e.to_status,
                "reason": e.reason,
                "actor": e.actor,
                "attempt": e.attempt,
            }
            for e in job.events
        ]
    return data
