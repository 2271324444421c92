"""The gang claim of a multi-node job (or a job group spread over several VMs): the GPUs of
every node (rank), each on a VM of its own, all in the caller's transaction or none
(docs/invariants.md, invariant 1); else the job waits `pending` with the reason, in the
words `job list` shows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, insert, literal_column, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from scheduler.attempts.shape import JobShape
from scheduler.claims.result import Claim, NoClaim, NodeClaim, job_env_pairs
from scheduler.claims.why import park, waiting_reason
from scheduler.db import installation_id
from scheduler.gpus import FREE_BY_VM_SQL, LOCK_FREE_ON_VM_SQL
from scheduler.jobs import transition
from scheduler.models import Job, JobNode
from scheduler.placement import (
    demand_order,
    demands_fit,
    vm_order,
)
from scheduler.remote.layout import default_output_dir, new_token
from scheduler.states import JobStatus


def gang_demands(row: Any) -> list[int]:
    """The GPUs each node (rank) of a multi-node job needs, rank 0 first, from its shape
    (`JobShape.demands`). The row was checked first (`job_row_problem`)."""
    return list(JobShape.of_row(row).demands)


async def _lock_gang(
    conn: AsyncConnection, free: dict[int, int], demands: Sequence[int], job_id: int
) -> list[tuple[int, list[Any]]] | None:
    """Lock `demands[r]` free GPU rows for each node r, every node on a VM of its own:
    nodes most demanding first (`demand_order`), each on the first VM of `vm_order` not
    tried yet whose rows it can lock (SKIP LOCKED). None when some node found none."""
    chosen: dict[int, tuple[int, list[Any]]] = {}
    tried: set[int] = set()
    for node in demand_order(list(demands)):
        need = demands[node]
        for vm_id in vm_order(free, need, job_id):
            if vm_id in tried:
                continue
            tried.add(vm_id)
            gpus = (await conn.execute(LOCK_FREE_ON_VM_SQL, {"vm_id": vm_id, "need": need})).all()
            if len(gpus) == need:
                chosen[node] = (vm_id, list(gpus))
                break
        else:
            return None
    return [chosen[node] for node in range(len(demands))]


async def claim_gang(
    conn: AsyncConnection,
    row: Any,
    actor: str,
    lease_s: float,
    demands: Sequence[int] | None = None,
) -> Claim | NoClaim:
    """Claim the GPUs of every node of one queued, locked multi-node job (`demands`, one
    GPU count per node; `gang_demands(row)` when not given), all in the caller's
    transaction or none (docs/invariants.md, invariant 1): lock the free GPU rows of each
    node on a VM of its own (`_lock_gang`), and only once every node is locked take them
    and move the job `queued → starting`; else take nothing and say why."""
    job_id = row.id
    demands = list(demands if demands is not None else gang_demands(row))
    free = {int(vm): int(n) for vm, n in (await conn.execute(FREE_BY_VM_SQL)).all()}
    chosen = await _lock_gang(conn, free, demands, job_id) if demands_fit(free, demands) else None
    if chosen is None:
        if demands_fit(free, demands):
            # Enough VMs fit, but other claimers hold their rows: not a reason to wait.
            return NoClaim(job_id, row.status, "contended", contended=True)
        return await _park_gang(conn, row, actor, demands, free)
    ranks = tuple(
        NodeClaim(
            rank,
            vm_id,
            tuple(int(g.index) for g in gpus),
            tuple(str(g.uuid) for g in gpus),
        )
        for rank, (vm_id, gpus) in enumerate(chosen)
    )
    await _take_gpus(conn, job_id, [g.id for _vm, gpus in chosen for g in gpus])
    installation = await installation_id(conn)
    token = new_token()
    job = await _start_gang(conn, job_id, ranks, demands, actor, lease_s, installation, token)
    await _record_nodes(conn, job_id, job.attempt, ranks)
    first = ranks[0]
    return Claim(
        job_id,
        job.attempt,
        first.vm_id,
        list(first.gpu_indices),
        job.output_dir,
        model=row.model,
        dataset=row.dataset,
        reward_functions=tuple(r for r in row.reward_function.split(",") if r),
        extra_args=tuple(str(a) for a in row.extra_args or ()),
        gpu_uuids=first.gpu_uuids,
        installation=installation,
        token=token,
        env=job_env_pairs(row.env),
        workdir=row.workdir_digest,
        store=row.store,
        nodes=ranks,
        roles=row.roles,
        shape=JobShape.of_row(row),
    )


async def _take_gpus(conn: AsyncConnection, job_id: int, ids: list[Any]) -> None:
    """Give the gang's locked GPU rows (`ids`) to the job; every one or an error."""
    taken = await conn.execute(
        text(
            "UPDATE gpus SET job_id = :job_id, allocated_at = clock_timestamp(), "
            "updated_at = clock_timestamp() WHERE id = ANY(:ids) AND job_id IS NULL "
            "RETURNING id"
        ),
        {"job_id": job_id, "ids": ids},
    )
    if len(taken.all()) != len(ids):  # cannot happen under the row locks; never half
        raise RuntimeError(f"gang claim of job {job_id} lost a locked GPU row")


async def _start_gang(
    conn: AsyncConnection,
    job_id: int,
    ranks: Sequence[NodeClaim],
    demands: Sequence[int],
    actor: str,
    lease_s: float,
    installation: str,
    token: str,
) -> Any:
    """`transition(queued → starting)` of a gang whose GPUs were just taken, rank 0's VM
    and GPUs on the job row; returns the new (attempt, output_dir)."""
    first = ranks[0]
    moved = await transition(
        AsyncSession(bind=conn),
        job_id,
        expected=JobStatus.QUEUED,
        to=JobStatus.STARTING,
        reason=f"claimed {_claimed_text(demands)} GPUs on VMs "
        + ",".join(str(r.vm_id) for r in ranks),
        actor=actor,
        values={
            "attempt": Job.attempt + 1,
            "vm_id": first.vm_id,
            "gpu_indices": list(first.gpu_indices),
            "gpu_uuids": list(first.gpu_uuids),
            "output_dir": func.coalesce(Job.output_dir, default_output_dir(installation, job_id)),
            "lease_expires_at": func.clock_timestamp()
            + literal_column(f"make_interval(secs => {float(lease_s)!r})"),
            "launch_token": token,
            "attempt_dir": None,
            "completed_attempt": None,
            "status_reason": None,
            "failure_reason": None,
            "exit_code": None,
            "remote_pid": None,
        },
    )
    if not moved:  # the row is locked and queued: cannot happen; take nothing
        raise RuntimeError(f"gang claim of job {job_id} could not move it")
    return (await conn.execute(select(Job.attempt, Job.output_dir).where(Job.id == job_id))).one()


async def _record_nodes(
    conn: AsyncConnection, job_id: int, attempt: int, ranks: Sequence[NodeClaim]
) -> None:
    """The attempt's `job_nodes` rows, one per rank, replacing the job's earlier ones."""
    await conn.execute(delete(JobNode).where(JobNode.job_id == job_id))
    await conn.execute(
        insert(JobNode),
        [
            {
                "job_id": job_id,
                "rank": r.rank,
                "attempt": attempt,
                "vm_id": r.vm_id,
                "gpu_indices": list(r.gpu_indices),
                "gpu_uuids": list(r.gpu_uuids),
            }
            for r in ranks
        ],
    )


def _claimed_text(demands: Sequence[int]) -> str:
    """`2 × 4` (every node alike) or `4+2+1` (per node, rank 0 first), in an event."""
    if len(set(demands)) == 1:
        return f"{len(demands)} × {demands[0]}"
    return "+".join(str(n) for n in demands)


async def _park_gang(
    conn: AsyncConnection, row: Any, actor: str, demands: Sequence[int], free: dict[int, int]
) -> NoClaim:
    """`queued → pending` for a multi-node job that fits nowhere now, with the reason."""
    return await park(conn, row.id, await waiting_reason(conn, demands, free), actor)
