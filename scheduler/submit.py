"""Submitting a job: insert it (short transaction), then publish its id (no transaction)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import bus
from scheduler.attempts.shape import JobShape
from scheduler.errors import BadInput
from scheduler.jobstore import (
    LARGEST_VM_SQL,
    UNPOLLED_VMS_SQL,
    VM_COUNT_SQL,
    VMS_WITH_SQL,
    JobSpec,
    SqlDatabase,
    SqlTx,
    insert_job,
    mark_published,
)
from scheduler.placement import unsatisfiable_gang_reason, unsatisfiable_reason
from scheduler.settings import Settings, redact_url

# No SQLAlchemy here: `job submit` runs this over its own psycopg connection
# (`scheduler.pgconn`), the daemons and tests over a `Database`; both are `SqlDatabase`s.


@dataclass(frozen=True)
class Submitted:
    """The new job's id, and why it was not published if it was not."""

    job_id: int
    publish_error: str | None = None
    warning: str | None = None
    """Something the user should know although the job was accepted."""


async def _count(tx: SqlTx, sql: str, **params: int) -> int:
    """The one number `sql` selects (as `n`)."""
    (row,) = await tx.rows(sql, params)
    return int(row["n"] or 0)


async def check_fits(tx: SqlTx, gpus: int, nodes: int = 1) -> str | None:
    """Refuse (`BadInput`) a job that asks for more GPUs than any VM of the polled fleet has
    (for `nodes` > 1: than `nodes` different VMs have).

    A VM that was never polled may have any number: when one exists, or when no VM is
    registered yet (a fresh installation), the job is accepted and the returned warning
    says that its size could not be checked."""
    largest = await _count(tx, LARGEST_VM_SQL)
    big_enough = await _count(tx, VMS_WITH_SQL, need=gpus)
    if gpus <= largest and big_enough >= nodes:
        return None
    unpolled = [row["name"] for row in await tx.rows(UNPOLLED_VMS_SQL)]
    total = await _count(tx, VM_COUNT_SQL)
    unit = "GPU" if gpus == 1 else "GPUs"
    if not total:
        return f"no VM is registered yet, so nobody knows whether {gpus} {unit} will fit"
    if nodes > 1 and gpus <= largest:
        if unpolled:
            return (
                f"only {big_enough} polled VM(s) have {gpus} {unit}, {nodes} are needed; "
                f"accepted because VM(s) {', '.join(unpolled[:3])} have not been polled yet"
            )
        raise BadInput(
            f"{unsatisfiable_gang_reason(nodes, gpus, big_enough)}: the job could never run; "
            "ask for fewer nodes or GPUs, or add VMs"
        )
    if unpolled:
        names = ", ".join(unpolled[:3]) + (" …" if len(unpolled) > 3 else "")
        return (
            f"no polled VM has {gpus} {unit} (the largest has {largest}); accepted because "
            f"VM(s) {names} have not been polled yet"
        )
    raise BadInput(
        f"{unsatisfiable_reason(gpus, largest)}: the job could never run; ask for fewer "
        "GPUs or add a bigger VM"
    )


async def _check_spec_fits(tx: SqlTx, spec: JobSpec) -> str | None:
    """`check_fits` for the job's shape (`JobShape.of_spec`): a job over several VMs needs
    its largest node on some VM and as many VMs as it has nodes with its smallest node's
    GPUs (the claim places the exact per-node counts, `placement.demands_fit`)."""
    demands = JobShape.of_spec(spec).demands
    if len(set(demands)) == 1:
        return await check_fits(tx, demands[0], len(demands))
    return await check_fits(tx, max(demands)) or await check_fits(tx, min(demands), len(demands))


async def submit_job(
    db: SqlDatabase, settings: Settings, spec: JobSpec, *, actor: str
) -> Submitted:
    """Insert the job as `queued`, then publish its id to `jobs.new`. A job no VM of the
    polled fleet could ever run is refused (`check_fits`).

    The row is committed first, so a NATS outage loses nothing: the requeue manager
    publishes queued jobs whose `published_at` is NULL. `job submit` runs this over its
    own connection (`pgconn.PgDatabase`), everything else over a `Database`.
    """
    spec.validate()
    async with db.sql_transaction() as tx:
        warning = await _check_spec_fits(tx, spec)
        job = await insert_job(tx, spec, actor=actor)
        job_id, attempt = job.id, job.attempt
    published = await announce(db, settings, job_id, bus.msg_id(job_id, attempt))
    return Submitted(job_id, published, warning)


async def announce(db: SqlDatabase, settings: Settings, job_id: int, msg_id: str) -> str | None:
    """Publish a queued job's id to `jobs.new` (no transaction open), then record that it
    was announced. Returns why it did not reach NATS, or None; a job left unannounced is
    announced by the requeue manager, so nothing is lost either way.

    `msg_id` is the `Nats-Msg-Id` the requeue manager would use for the same queued spell
    (`bus.msg_id(job_id, attempt)`), so that a race between the two publishes once."""
    try:
        nc = await bus.connect(settings, name="rlfleet-cli")
    except Exception as exc:  # noqa: BLE001 - any connect failure means "not published"
        reason = str(exc) or type(exc).__name__
        return f"cannot reach NATS at {redact_url(settings.nats_url)}: {reason}"
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        await bus.publish_job(js, job_id, dedupe_id=msg_id)
    except Exception as exc:  # noqa: BLE001
        return f"publishing to {bus.SUBJECT_NEW} failed: {exc or type(exc).__name__}"
    finally:
        await nc.close()
    async with db.sql_transaction() as tx:
        await mark_published(tx, job_id)
    return None
