"""A claim that found no room on the whole fleet: the job moves `queued → pending` with the
reason, in the words `job list` shows (`park`, one for every kind of job). The words for a
job of one rank (`pending_reason`, `placement.unsatisfiable_reason`) and for a gang
(`gang_wait_reason`, `gang_never_reason`) are kept as they were."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from scheduler.attempts.shape import JobShape
from scheduler.claims.result import NoClaim
from scheduler.gpus import VM_SIZES_SQL
from scheduler.jobs import transition
from scheduler.placement import short_of, unsatisfiable_gang_reason, unsatisfiable_reason
from scheduler.states import JobStatus


def pending_reason(need: int, largest_free: int) -> str:
    """Why a job of one rank waits, in the words `job list` shows."""
    unit = "GPU" if need == 1 else "GPUs"
    return f"needs {need} {unit}, largest free block is {largest_free}"


def gang_pending_reason(nodes: int, need: int, fitting: int) -> str:
    """Why a multi-node job waits, in the words `job list` shows."""
    unit = "GPU" if need == 1 else "GPUs"
    verb = "has" if fitting == 1 else "have"
    return f"needs {nodes} VMs with {need} free {unit}; {fitting} {verb} them"


def _demands_text(demands: Sequence[int]) -> str:
    """`4, 2 and 1`: a gang's per-node GPU counts, most first, in a reason."""
    words = [str(n) for n in sorted(demands, reverse=True)]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def gang_wait_reason(demands: Sequence[int], free_by_vm: dict[int, int]) -> str:
    """Why a gang with these per-node demands waits on VMs with these free GPUs (the
    words of `gang_pending_reason` when every node needs the same)."""
    short = short_of(free_by_vm, list(demands))
    n, need, have = short or (len(demands), max(demands), len(free_by_vm))
    if len(set(demands)) == 1:
        return gang_pending_reason(len(demands), need, have)
    return (
        f"needs {len(demands)} VMs with {_demands_text(demands)} free GPUs; "
        f"{have} VM(s) have {need} free, {n} needed"
    )


def gang_never_reason(demands: Sequence[int], sizes: dict[int, int]) -> str | None:
    """Why a gang can never run on VMs of these sizes (None when it could): the words of
    `unsatisfiable_gang_reason` when every node needs the same."""
    short = short_of(sizes, list(demands))
    if short is None:
        return None
    n, need, have = short
    if len(set(demands)) == 1:
        return unsatisfiable_gang_reason(len(demands), need, have)
    return (
        f"needs {len(demands)} VMs with {_demands_text(demands)} GPUs; "
        f"only {have} VM(s) have {need} or more, {n} needed"
    )


def wait_reason(demands: Sequence[int], free_by_vm: dict[int, int], sizes: Sequence[int]) -> str:
    """Why an attempt needing `demands` (one GPU count per rank) waits on VMs with these
    free GPUs, or can never run on VMs of these sizes."""
    if len(demands) == 1:
        need, largest_vm = demands[0], max(sizes, default=0)
        if need > largest_vm:
            return unsatisfiable_reason(need, largest_vm)
        return pending_reason(need, max(free_by_vm.values(), default=0))
    never = gang_never_reason(demands, dict(enumerate(sizes)))
    return never or gang_wait_reason(demands, free_by_vm)


async def park(
    conn: AsyncConnection, row: Any, shape: JobShape, free_by_vm: dict[int, int], actor: str
) -> NoClaim:
    """`queued → pending` for a job that fits nowhere now (`free_by_vm`: the whole fleet's
    free GPUs), with the reason."""
    sizes = [int(n) for n in (await conn.scalars(VM_SIZES_SQL)).all()]
    reason = wait_reason(shape.demands, free_by_vm, sizes)
    moved = await transition(
        AsyncSession(bind=conn),  # a session over the connection joins its transaction
        row.id,
        expected=JobStatus.QUEUED,
        to=JobStatus.PENDING,
        reason=reason,
        actor=actor,
        values={"status_reason": reason},
    )
    return NoClaim(row.id, JobStatus.PENDING.value, reason, moved_to_pending=moved)
