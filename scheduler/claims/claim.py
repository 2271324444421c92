"""The one claim path, for every kind of job: a job of one rank (a single-node training
job, a group on one VM) is an attempt of one rank, a multi-node job or a group over several
VMs one of several, and all are claimed alike (`claim`):

1. a batch locks, once, the GPU rows its shortlist names (`lock_shortlist`: `Locked`, the
   rows the batch holds);
2. each claim assigns every rank its VM and GPUs among the locked rows (`placement.assign`,
   pure); when they have no room (or the batch is of one job), it locks candidate rows on
   the whole fleet (`statements.LOCK_SQL`) and assigns among those;
3. it takes them, moves the job `queued → starting` with its event and writes every
   rank's `job_nodes` row (`statements.TAKE_SQL`).

All in the caller's transaction, every rank or none (docs/invariants.md, invariant 1). The
whole fleet alone decides `contended` (enough room on the count, but other claimers hold
the rows: try again soon) and `pending` (`why.park`, with the reason that
`why.waiting_reason` gives). The per-rank demands are the job's shape's
(`JobShape.demands`) and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncConnection

from scheduler.attempts.shape import JobShape
from scheduler.claims.result import Claim, NoClaim, NodeClaim, job_env_pairs
from scheduler.claims.statements import LOCK_SHORTLIST_SQL, LOCK_SQL, TAKE_SQL
from scheduler.claims.why import park, waiting_reason
from scheduler.gpus import FREE_BY_VM_SQL
from scheduler.placement import assign, demands_fit, lock_levels, shortlist
from scheduler.remote.layout import ROOT, new_token

CANDIDATE_VMS = 4
"""How many best-fitting VMs a claim of one rank locks rows on (a gang: one more for each
further rank, `placement.lock_levels`); more than one so that a VM whose free GPUs another
dispatcher holds locked right now does not make the claim miss."""


@dataclass(frozen=True)
class LockedGpu:
    """A free GPU row the claim holds locked."""

    id: int
    index: int
    uuid: str


@dataclass
class Locked:
    """What a lock statement found: the rows it locked on each VM (VM → (its free GPUs,
    the rows), both less what claims since took) and the free GPUs of every VM it counted
    (the whole fleet's, for `LOCK_SQL`). A batch's (`lock_shortlist`) changes as its
    claims take rows and lock more; the rows stay locked until the batch commits."""

    rows: dict[int, tuple[int, list[LockedGpu]]]
    free_by_vm: dict[int, int]

    def assign(self, demands: Sequence[int], job_id: int) -> Placed | None:
        """Every rank's VM and rows among these (`placement.assign`)."""
        return assign(demands, self.rows, job_id, _index)

    def add(self, other: Locked) -> None:
        """Hold `other`'s rows too (a later count of a VM's free GPUs wins)."""
        for vm, (free, rows) in other.rows.items():
            known = {g.id for g in self.rows.get(vm, (0, []))[1]}
            self.rows[vm] = (
                free,
                self.rows.get(vm, (0, []))[1] + [g for g in rows if g.id not in known],
            )

    def remove(self, placed: Placed) -> None:
        """Forget the rows a claim took (and count them taken on their VMs)."""
        for vm, gpus in placed:
            if vm in self.rows:
                free, rows = self.rows[vm]
                ids = {g.id for g in gpus}
                self.rows[vm] = (free - len(gpus), [g for g in rows if g.id not in ids])

    @classmethod
    def of(cls, found: Row[Any]) -> Locked:
        """The lock statement's one row, read."""
        rows: dict[int, tuple[int, list[LockedGpu]]] = {}
        cols = (found.vms, found.frees, found.ids, found.indices, found.uuids)
        for vm, free, id_, index, uuid in zip(*(c or () for c in cols), strict=True):
            rows.setdefault(int(vm), (int(free), []))[1].append(
                LockedGpu(int(id_), int(index), str(uuid))
            )
        fleet = zip(found.fleet_vms or (), found.fleet_free or (), strict=True)
        return cls(rows, {int(vm): int(n) for vm, n in fleet})


Placed = list[tuple[int, list[LockedGpu]]]
"""Every rank's (VM, GPU rows), rank 0 first."""


async def claim(
    conn: AsyncConnection,
    row: Any,
    shape: JobShape,
    *,
    actor: str,
    lease_s: float,
    candidates: int = CANDIDATE_VMS,
    pool: Locked | None = None,
) -> Claim | NoClaim:
    """Claim the GPUs of every rank of one queued job whose row the caller holds locked
    (`shape`: the row's; `pool`: the rows its batch locked), or park it `pending`, or say
    the GPUs are contended."""
    demands = list(shape.demands)
    placed = pool.assign(demands, row.id) if pool is not None else None
    if placed is None:
        # Pending and contended are only ever decided on the whole fleet.
        found = await lock_fleet(conn, row.id, demands, candidates, pool)
        placed = found.assign(demands, row.id)
        if placed is None:
            if demands_fit(found.free_by_vm, demands):
                # Free GPUs exist but other claimers hold them: not a reason to wait.
                return NoClaim(row.id, row.status, "contended", contended=True)
            return await park(
                conn, row.id, await waiting_reason(conn, shape.demands, found.free_by_vm), actor
            )
    if pool is not None:
        pool.remove(placed)
    return await _take(conn, row, shape, placed, actor=actor, lease_s=lease_s)


async def lock_fleet(
    conn: AsyncConnection,
    job_id: int,
    demands: Sequence[int],
    candidates: int,
    pool: Locked | None,
) -> Locked:
    """Lock candidate rows for every rank on the whole fleet (`LOCK_SQL`). Inside a batch
    whose rows had no room (`pool`), twice as many VMs are tried, and the rows locked and
    not taken join the batch's, for its next claims."""
    levels = lock_levels(demands, candidates * (1 if pool is None else 2))
    params = {
        "job_id": job_id,
        "needs": [need for need, _top in levels],
        "tops": [top for _need, top in levels],
    }
    found = Locked.of((await conn.execute(LOCK_SQL, params)).one())
    if pool is not None:
        pool.add(found)
    return found


def _index(gpu: LockedGpu) -> int:
    """A locked row's GPU index (what `placement.gpu_order` orders by)."""
    return gpu.index


async def _take(
    conn: AsyncConnection, row: Any, shape: JobShape, placed: Placed, *, actor: str, lease_s: float
) -> Claim:
    """Give the placed rows to the job and start its attempt (`TAKE_SQL`); the claim."""
    ids = [g.id for _vm, gpus in placed for g in gpus]
    ranks = tuple(
        NodeClaim(rank, vm, tuple(g.index for g in gpus), tuple(g.uuid for g in gpus))
        for rank, (vm, gpus) in enumerate(placed)
    )
    done = (
        await conn.execute(
            TAKE_SQL,
            {
                "job_id": row.id,
                "ids": ids,
                "ranks": [r.rank for r in ranks for _g in r.gpu_indices],
                "n": len(ids),
                "nodes": len(ranks),
                "root": ROOT,
                "token": new_token(),
                "lease_s": lease_s,
                "actor": actor,
                "reason": claimed_reason(ranks),
            },
        )
    ).one()
    if done.attempt is None:  # cannot happen under the row locks; raise, never take half
        raise RuntimeError(f"claim of job {row.id} took {done.taken} of {len(ids)} locked GPUs")
    first = ranks[0]
    return Claim(
        row.id,
        done.attempt,
        first.vm_id,
        list(first.gpu_indices),
        done.output_dir,
        model=row.model,
        dataset=row.dataset,
        reward_functions=tuple(r for r in row.reward_function.split(",") if r),
        extra_args=tuple(str(a) for a in row.extra_args or ()),
        gpu_uuids=first.gpu_uuids,
        installation=done.installation,
        token=done.launch_token,
        env=job_env_pairs(row.env),
        workdir=row.workdir_digest,
        store=row.store,
        nodes=ranks if len(ranks) > 1 else (),
        roles=row.roles,
        shape=shape,
    )


def claimed_reason(ranks: Sequence[NodeClaim]) -> str:
    """The claim's event: `claimed GPUs 0,1` for one rank; `claimed 2 × 4 GPUs on VMs 3,5`
    (every rank alike) or `claimed 4+2 GPUs on VMs 3,5` (per rank, rank 0 first)."""
    if len(ranks) == 1:
        return "claimed GPUs " + ",".join(str(i) for i in ranks[0].gpu_indices)
    counts = [len(r.gpu_indices) for r in ranks]
    each = f"{len(counts)} × {counts[0]}" if len(set(counts)) == 1 else "+".join(map(str, counts))
    return f"claimed {each} GPUs on VMs " + ",".join(str(r.vm_id) for r in ranks)


async def lock_shortlist(
    conn: AsyncConnection, shapes: Sequence[tuple[int, JobShape]], candidates: int
) -> Locked:
    """Lock the rows a batch's claims look at first (`placement.shortlist` over one count
    of the free GPUs), for the (job id, shape) of each queued job."""
    free = (await conn.execute(FREE_BY_VM_SQL)).all()
    named = shortlist(
        ((int(vm_id), int(n)) for vm_id, n in free),
        ((job_id, shape.demands) for job_id, shape in shapes),
        candidates,
    )
    if not named:
        return Locked({}, {})
    params = {"vm_ids": list(named), "counts": list(named.values())}
    return Locked.of((await conn.execute(LOCK_SHORTLIST_SQL, params)).one())
