"""What the pages show, read with the same functions as the CLI's `--json` listings
(`jobs.list_jobs`, `control.job_details`, `fleet.list_vms`/`vm_to_dict`),
plus the history the poller keeps (`scheduler.history`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import fleet, history
from scheduler.jobs import list_jobs
from scheduler.models import GPU, VM, Job
from scheduler.states import JobStatus

if TYPE_CHECKING:
    from scheduler.db import Database
    from scheduler.job_logs import Diagnostics

QUEUE_GROUPS: tuple[tuple[str, tuple[JobStatus, ...]], ...] = (
    ("running", (JobStatus.RUNNING,)),
    ("starting", (JobStatus.STARTING,)),
    ("pending", (JobStatus.PENDING, JobStatus.QUEUED)),
    # A failed job is not final (it may be retried) but it has finished running: without it
    # here the queue page would show a failure nowhere.
    ("finished", (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)),
)
"""The queue page's sections, in order, and the states each shows (every state once)."""
LIVE_LIMIT = 500
"""Most jobs a live section lists (the count says how many there are)."""
FINISHED_LIMIT = 50
"""The finished section lists the most recent ones only."""
VMS_PER_PAGE = 50
DEFAULT_HOURS = 3.0


async def queue_snapshot(
    session: AsyncSession,
    *,
    status: JobStatus | None = None,
    name: str | None = None,
    finished_limit: int = FINISHED_LIMIT,
) -> dict[str, Any]:
    """The queue page: each section's jobs (as `job list --json`) and the count of every
    state, filtered by state and by a part of the name."""
    counts_query = select(Job.status, func.count()).group_by(Job.status)
    if name:
        counts_query = counts_query.where(Job.name.icontains(name, autoescape=True))
    counts = {s.value: 0 for s in JobStatus}
    counts.update({row[0]: int(row[1]) for row in await session.execute(counts_query)})
    sections: dict[str, list[dict[str, Any]]] = {}
    for section, states in QUEUE_GROUPS:
        wanted = [s for s in states if status is None or s == status]
        if not wanted:
            sections[section] = []
            continue
        limit = finished_limit if section == "finished" else LIVE_LIMIT
        sections[section] = await list_jobs(session, status=wanted, limit=limit, name=name)
    return {"sections": sections, "counts": counts}


async def job_curve(session: AsyncSession, job_id: int) -> list[dict[str, Any]]:
    """The reward and loss of every recorded step of the job's attempts."""
    return await history.job_curve(session, job_id)


async def fleet_snapshot(
    session: AsyncSession,
    *,
    name: str | None = None,
    page: int = 1,
    per_page: int = VMS_PER_PAGE,
    hours: float = DEFAULT_HOURS,
) -> dict[str, Any]:
    """The fleet page: one page of VMs (as `vm list --json`, each GPU with its `state`) with
    their utilisation and memory timelines (`timeline_start` to `timeline_end`, seconds
    since the epoch: the last `hours`, or less when the samples begin later), and the state
    counts of every GPU."""
    total_query = select(func.count()).select_from(VM)
    if name:
        total_query = total_query.where(VM.name.icontains(name, autoescape=True))
    total = int(await session.scalar(total_query) or 0)
    vms = await fleet.list_vms(session, name=name, limit=per_page, offset=(page - 1) * per_page)
    vm_ids = [vm.id for vm in vms]
    # One span for the whole page, so that the rows' timelines line up.
    span = await history.timeline_span(session, vm_ids, hours=hours)
    timelines = await history.vm_timelines(session, vm_ids, hours=hours, span=span)
    rows = []
    for vm in vms:
        data = fleet.vm_to_dict(vm)
        data["timeline"] = timelines.get(vm.id, [])
        rows.append(data)
    return {
        "vms": rows,
        "total": total,
        "page": page,
        "pages": max(1, -(-total // per_page)),
        "hours": hours,
        "timeline_start": span.start,
        "timeline_end": span.end,
        "gpu_states": await gpu_state_counts(session),
    }


async def gpu_state_counts(session: AsyncSession) -> dict[str, int]:
    """How many GPUs of the whole fleet are free, allocated, drained, foreign or unhealthy."""
    state = fleet_gpu_state_sql()
    counts = {"free": 0, "allocated": 0, "drained": 0, "foreign": 0, "unhealthy": 0}
    for row in await session.execute(select(state, func.count()).group_by(state)):
        counts[row[0]] = int(row[1])
    return counts


def fleet_gpu_state_sql() -> Any:
    """`fleet.gpu_state` as a SQL expression, to count in the database."""
    from sqlalchemy import case

    return case(
        (GPU.healthy.is_(False), "unhealthy"),
        (GPU.job_id.is_not(None), "allocated"),
        (GPU.drained.is_(True), "drained"),
        (GPU.foreign_busy.is_(True), "foreign"),
        else_="free",
    )


async def job_diagnostics(db: Database, job_id: int) -> Diagnostics | None:
    """The newest diagnostics of the job (an attempt stopped as hung or stuck starting),
    as `job logs --diagnostics` prints them; None when it has none."""
    from scheduler.errors import BadInput
    from scheduler.job_logs import read_diagnostics

    try:
        return await read_diagnostics(db, job_id)
    except BadInput:
        return None
