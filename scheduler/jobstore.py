"""Creating and listing jobs as SQL text, with no ORM: the one definition of the new job's
rows, of the job listing and of a job as plain data.

The statements take psycopg's `%(name)s` parameters and run over any `SqlTx`: the command
line's own psycopg connection (`scheduler.pgconn`, so that `job list` and `job submit`
start without loading SQLAlchemy), and a SQLAlchemy session (`scheduler.db.SessionSql`)
in the daemons, the web dashboard and the tests. Both paths therefore write and read the
same rows (tests/integration/test_jobstore.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.errors import BadInput
from scheduler.states import JobStatus
from scheduler.validate import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    DIGEST_RE,
    INT4,
    JOB_NAME_MAX,
    MAX_ENV_VALUE,
    MAX_GPUS,
    MAX_NODES,
    MAX_RETRIES,
    TEXT_MAX,
    WORKDIR_MAX_BYTES,
    UnreadableJson,
    check_int,
    check_text,
    check_timeout,
    env_key_problem,
    extra_args_problem,
)

if TYPE_CHECKING:
    from scheduler.workdir import PackedWorkdir


class SqlTx(Protocol):
    """One open transaction that runs SQL text with `%(name)s` parameters."""

    async def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run `sql`; the rows it returns (none for a statement without a result)."""
        ...


class SqlDatabase(Protocol):
    """Something that opens short transactions of `SqlTx` (`Database`, `PgDatabase`)."""

    def sql_transaction(self) -> AbstractAsyncContextManager[SqlTx]:
        """One short transaction: committed on success, rolled back on error."""
        ...


def colon_style(sql: str) -> str:
    """`sql` with SQLAlchemy `text()`'s `:name` parameters instead of `%(name)s`."""
    return re.sub(r"%\((\w+)\)s", r":\1", sql).replace("%%", "%")


# -- a new job ---------------------------------------------------------------------------

EVENT_COLUMNS = ("job_id", "from_status", "to_status", "reason", "actor", "attempt")
"""The columns of a `job_events` row, in the order the event inserts fill them."""


@dataclass(frozen=True)
class JobSpec:
    """What a user gives to submit a job."""

    model: str
    dataset: str
    reward_functions: tuple[str, ...]
    gpus: int = 1
    """GPUs on each node (`--gpus`) of a training job; a group's every GPU, its roles'
    together (`cli.jobfile.group_job_spec`). Stored as every GPU of an attempt
    (`gpus_total`)."""
    nodes: int = 1
    """VMs the job spans (`--nodes`), `gpus` on each for a training job."""
    max_retries: int = 3
    priority: int = 0
    name: str | None = None
    extra_args: tuple[str, ...] = ()
    output_dir: str | None = None
    """Where train_grpo.py writes on the VM; None means `remote.layout.default_output_dir`."""
    env: tuple[tuple[str, str], ...] = ()
    """`--env KEY=VALUE` pairs for the job's environment."""
    roles: dict[str, Any] | None = None
    """A job group's roles (`jobspec.GroupSpec.to_data`); None for one training role."""
    workdir: PackedWorkdir | None = None
    """The job's packed workdir (`job submit --workdir`, `scheduler.workdir.pack`); None
    for a job without one."""
    hang_timeout_s: int = DEFAULT_HANG_TIMEOUT_S
    """`--hang-timeout`: a running attempt whose step has not advanced this long is hung;
    0: never."""
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    """`--startup-timeout`: a running attempt with no first step this long is stuck; 0: never."""
    store: str | None = None
    """The job's store URL (`scheduler.store.parse_store_url`); None: no store."""

    @property
    def gpus_total(self) -> int:
        """Every GPU an attempt of the job holds, all its VMs together
        (`jobs.gpus_requested`)."""
        return self.gpus * self.nodes if self.roles is None else self.gpus

    def validate(self) -> None:
        """Raise `BadInput` for a job that could never run or that the schema cannot hold
        (the limits of `scheduler.validate`, which size the columns)."""
        validate_job_env(self.env)
        check_text(self.model, "--model", max_len=TEXT_MAX)
        check_text(self.dataset, "--dataset", max_len=TEXT_MAX)
        if not self.reward_functions:
            raise BadInput("--reward-function must not be empty")
        for reward in self.reward_functions:
            check_text(reward, "--reward-function", max_len=TEXT_MAX)
        if any("," in r for r in self.reward_functions):
            raise BadInput("give several reward functions as repeated --reward-function flags")
        check_text(",".join(self.reward_functions), "--reward-function", max_len=TEXT_MAX)
        if self.gpus < 1:
            raise BadInput(f"--gpus must be at least 1, not {self.gpus}")
        check_int(self.gpus, "--gpus", bounds=INT4, lo=1, hi=MAX_GPUS)
        check_int(self.nodes, "--nodes", bounds=INT4, lo=1, hi=MAX_NODES)
        if self.max_retries < 0:
            raise BadInput(f"--max-retries must not be negative, not {self.max_retries}")
        check_int(self.max_retries, "--max-retries", bounds=INT4, lo=0, hi=MAX_RETRIES)
        check_int(self.priority, "--priority", bounds=INT4)
        if self.name is not None:
            check_text(self.name, "--name", max_len=JOB_NAME_MAX)
        if self.output_dir is not None:
            check_text(self.output_dir, "--output-dir", max_len=TEXT_MAX)
        problem = extra_args_problem(self.extra_args)
        if problem:
            raise BadInput(problem)
        if self.workdir is not None:
            if not DIGEST_RE.fullmatch(self.workdir.digest):
                raise BadInput("--workdir: not a packed workdir")
            if self.workdir.size > WORKDIR_MAX_BYTES:
                raise BadInput(f"--workdir: packs to more than {WORKDIR_MAX_BYTES} bytes")
        check_timeout(self.hang_timeout_s, "--hang-timeout")
        check_timeout(self.startup_timeout_s, "--startup-timeout")
        if self.store is not None:
            from scheduler.store import parse_store_url

            try:
                parse_store_url(self.store)
            except ValueError as exc:
                raise BadInput(str(exc)) from None
            if self.roles is not None:
                raise BadInput("--store: a job group has no store yet (one training job only)")


def validate_job_env(env: Iterable[tuple[str, str]]) -> None:
    """Raise `BadInput` for a variable a job may not set, or a value that cannot be
    stored in the one-line-per-variable `job.env` (the value itself is never quoted)."""
    pairs = tuple(env)
    if not pairs:
        return
    seen: set[str] = set()
    for key, value in pairs:
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


INSERT_WORKDIR_SQL = """
INSERT INTO workdirs (digest, size, files, data)
VALUES (%(digest)s, %(size)s, %(files)s, %(data)s)
ON CONFLICT (digest) DO NOTHING
"""
"""A packed workdir, stored once per content: the same digest is the same bytes."""

INSERT_JOB_SQL = f"""
WITH job AS (
    INSERT INTO jobs (status, name, model, dataset, reward_function, gpus_requested, nodes,
                      max_retries, priority, extra_args, output_dir, env, roles, store,
                      workdir_digest, hang_timeout_s, startup_timeout_s, queued_at)
    VALUES ('{JobStatus.QUEUED.value}', %(name)s, %(model)s, %(dataset)s, %(reward_function)s,
            %(gpus)s, %(nodes)s, %(max_retries)s, %(priority)s, %(extra_args)s::jsonb,
            %(output_dir)s, %(env)s::jsonb, %(roles)s::jsonb, %(store)s, %(workdir)s,
            %(hang_timeout_s)s, %(startup_timeout_s)s, now())
    RETURNING id, attempt
), event AS (
    INSERT INTO job_events ({", ".join(EVENT_COLUMNS)})
    SELECT id, NULL, '{JobStatus.QUEUED.value}', 'submitted', %(actor)s, attempt FROM job
)
SELECT id, attempt FROM job
"""
"""A `queued` job and its first event, in one statement (`queued_at` is `submitted_at`:
both are the transaction's `now()`)."""


@dataclass(frozen=True)
class NewJob:
    """A job just inserted: its id and attempt (0)."""

    id: int
    attempt: int


def insert_params(spec: JobSpec, actor: str) -> dict[str, Any]:
    """The parameters of `INSERT_JOB_SQL` for `spec`."""
    return {
        "name": spec.name,
        "model": spec.model,
        "dataset": spec.dataset,
        "reward_function": ",".join(spec.reward_functions),
        "gpus": spec.gpus_total,
        "nodes": spec.nodes,
        "max_retries": spec.max_retries,
        "priority": spec.priority,
        "extra_args": json.dumps(list(spec.extra_args)),
        "output_dir": spec.output_dir,
        "env": json.dumps(dict(spec.env)),
        # SQL NULL, not a JSON null, for a job of one training role.
        "roles": json.dumps(spec.roles) if spec.roles is not None else None,
        "workdir": spec.workdir.digest if spec.workdir is not None else None,
        "hang_timeout_s": spec.hang_timeout_s,
        "startup_timeout_s": spec.startup_timeout_s,
        "store": spec.store,
        "actor": actor,
    }


async def insert_job(tx: SqlTx, spec: JobSpec, *, actor: str) -> NewJob:
    """Validate and insert a `queued` job with its first event, inside `tx`."""
    spec.validate()
    if spec.workdir is not None:
        await tx.rows(
            INSERT_WORKDIR_SQL,
            {
                "digest": spec.workdir.digest,
                "size": spec.workdir.size,
                "files": spec.workdir.files,
                "data": spec.workdir.data,
            },
        )
    (row,) = await tx.rows(INSERT_JOB_SQL, insert_params(spec, actor))
    return NewJob(int(row["id"]), int(row["attempt"]))


MARK_PUBLISHED_SQL = "UPDATE jobs SET published_at = now() WHERE id = %(job_id)s"


async def mark_published(tx: SqlTx, job_id: int) -> None:
    """Record that the job id was stored by the stream just now."""
    await tx.rows(MARK_PUBLISHED_SQL, {"job_id": job_id})


# -- what the fleet can hold -------------------------------------------------------------

LARGEST_VM_SQL = (
    "SELECT coalesce(max(n), 0) AS n FROM (SELECT count(*) AS n FROM gpus GROUP BY vm_id) c"
)
"""The most GPUs any one VM has, whatever its state: a job asking for more can never run
(until a bigger VM is added), so it is never worth waiting, or holding others back, for."""

VMS_WITH_SQL = (
    "SELECT count(*) AS n FROM (SELECT vm_id FROM gpus GROUP BY vm_id "
    "HAVING count(*) >= %(need)s) c"
)
"""How many VMs have at least `need` GPUs, whatever their state: a gang of more nodes than
that can never run."""

UNPOLLED_VMS_SQL = (
    "SELECT name FROM vms v WHERE v.last_seen_at IS NULL "
    "AND NOT EXISTS (SELECT 1 FROM gpus g WHERE g.vm_id = v.id) ORDER BY name"
)
"""The VMs never polled: they may have any number of GPUs."""

VM_COUNT_SQL = "SELECT count(*) AS n FROM vms"


# -- listing jobs ------------------------------------------------------------------------

JOB_FIELDS: tuple[tuple[str, str | None], ...] = (
    ("id", "id"),
    ("name", "name"),
    ("status", "status"),
    ("status_reason", "status_reason"),
    ("model", "model"),
    ("dataset", "dataset"),
    ("reward_function", "reward_function"),
    ("extra_args", "extra_args"),
    ("env_keys", None),
    ("gpus", "gpus_requested"),
    ("gpus_per_node", None),
    ("nodes", "nodes"),
    ("group", None),
    ("priority", "priority"),
    ("attempt", "attempt"),
    ("retry_count", "retry_count"),
    ("max_retries", "max_retries"),
    ("hang_timeout", "hang_timeout_s"),
    ("startup_timeout", "startup_timeout_s"),
    ("failure_reason", "failure_reason"),
    ("exit_code", "exit_code"),
    ("vm", None),
    ("gpu_indices", "gpu_indices"),
    ("gpu_uuids", "gpu_uuids"),
    ("remote_pid", "remote_pid"),
    ("output_dir", "output_dir"),
    ("workdir", "workdir_digest"),
    ("store", "store"),
    ("attempt_dir", "attempt_dir"),
    ("completed_attempt", "completed_attempt"),
    ("next_attempt_at", "next_attempt_at"),
    ("retry_decision", "retry_decision"),
    ("machine_faults", "machine_faults"),
    ("submitted_at", "submitted_at"),
    ("starting_at", "starting_at"),
    ("running_at", "running_at"),
    ("finished_at", "finished_at"),
)
"""A job as plain data (`--json`, the web API), in order: each key and the `jobs` column
it shows, or None for those that are not a column of the row: `env_keys` (the names of
the job's variables, never their values, which may be secrets), `vm` (its VM's name),
`group` (whether it is a job group) and `gpus_per_node` (each rank's GPUs, rank 0 first,
from the job's shape; `gpus` is every GPU of an attempt)."""

_COMPUTED_SQL = {
    # Only an object has keys: a row whose env is anything else (written by hand) shows
    # none, never its values.
    "env_keys": "ARRAY(SELECT jsonb_object_keys(CASE jsonb_typeof(j.env) WHEN 'object' "
    "THEN j.env ELSE '{}' END))",
    "vm": "v.name",
    "group": "coalesce(jsonb_typeof(j.roles) = 'object', false)",
    # The roles, read into each rank's GPUs by `job_dict` (through the job's shape).
    "gpus_per_node": "j.roles",
}


def _select_item(key: str, column: str | None) -> str:
    """One field of `JOB_FIELDS` as an item of the SELECT list over `jobs j`, `vms v`."""
    return f"{_COMPUTED_SQL[key] if column is None else 'j.' + column} AS {key}"


JOB_SELECT_SQL = (
    f"SELECT {', '.join(_select_item(key, column) for key, column in JOB_FIELDS)} "
    "FROM jobs j LEFT JOIN vms v ON v.id = j.vm_id"
)
"""Every field of `JOB_FIELDS`, for rows of `jobs j`."""


def job_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """A job as plain data from a row holding every key of `JOB_FIELDS` (`JOB_SELECT_SQL`,
    or an ORM job: `jobs.job_to_dict`)."""
    data = {key: row[key] for key, _ in JOB_FIELDS}
    data["gpus_per_node"] = gpus_per_node(data["nodes"], data["gpus_per_node"], data["gpus"])
    data["env_keys"] = sorted(data["env_keys"] or ())
    if isinstance(data["extra_args"], UnreadableJson):  # too deep to decode: shown as null
        data["extra_args"] = None
    return data


def gpus_per_node(nodes: Any, roles: Any, gpus: Any) -> list[int]:
    """Each rank's GPUs, rank 0 first, of a job row with these `nodes`, `roles` and
    `gpus_requested` (`JobShape.demands`)."""
    from scheduler.attempts.shape import JobShape

    return list(JobShape.of(nodes, roles, gpus).demands)


def gpus_text(job: Mapping[str, Any]) -> str:
    """A job's GPUs as a listing shows them (`job_dict`'s `gpus`, `gpus_per_node`): the
    count on its one VM, `4×2` for the same on each of several VMs, `3+1` for a group whose
    VMs need different counts."""
    each = job["gpus_per_node"]
    if len(each) <= 1:
        return str(job["gpus"])
    if len(set(each)) == 1:
        return f"{each[0]}×{len(each)}"
    return "+".join(map(str, each))


def list_jobs_sql(*, by_status: bool, by_name: bool) -> str:
    """The listing, newest first: `%(limit)s` rows, with `by_status` only those whose
    state is in `%(statuses)s`, with `by_name` only those whose name is like `%(name)s`."""
    where = []
    if by_status:
        where.append("j.status = ANY(%(statuses)s)")
    if by_name:
        where.append("j.name ILIKE %(name)s ESCAPE '\\'")
    condition = f" WHERE {' AND '.join(where)}" if where else ""
    return f"{JOB_SELECT_SQL}{condition} ORDER BY j.id DESC LIMIT %(limit)s"


def _like_pattern(text: str) -> str:
    """An ILIKE pattern matching names that contain `text` literally."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


async def list_jobs(
    tx: SqlTx,
    *,
    status: JobStatus | Collection[JobStatus] | None = None,
    limit: int = 100,
    name: str | None = None,
) -> list[dict[str, Any]]:
    """The newest jobs first as plain data (`job_dict`), optionally only those in `status`
    (one or several) and those whose name contains `name` (case-insensitive, literally)."""
    params: dict[str, Any] = {"limit": limit}
    if status is not None:
        wanted = [status] if isinstance(status, JobStatus) else list(status)
        params["statuses"] = [s.value for s in wanted]
    if name:
        params["name"] = _like_pattern(name)
    sql = list_jobs_sql(by_status=status is not None, by_name=bool(name))
    return [job_dict(row) for row in await tx.rows(sql, params)]
