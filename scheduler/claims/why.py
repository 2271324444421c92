"""Why a job waits: the pending reasons `job list` shows, naming the cause.

A job that fits nowhere waits with a headline — "needs 4 GPUs, largest free block is 2",
"needs 2 VMs with 4 free GPUs; 1 has them", or that the fleet could never run it — and,
when GPUs that would let it run exist but are kept out of use, which and why: "(vm-a: 2
GPUs unhealthy: <health reason>; vm-b: draining)". A VM is named when its GPUs that no
job holds would be enough but too few of them are free: a GPU unhealthy (`gpus.healthy`,
with its `health_reason`), drained by hand, busy with a process rlfleet did not start, or
held by a leftover; a VM draining, unreachable or unhealthy. A job a claim-time rule refuses
waits with the rule's words instead (`claims.rules`).

`explain` is pure; `waiting_reason` loads the fleet (one query, in the caller's
transaction) for it; `park` moves the job `queued → pending` with the reason. Names and
health texts come from rows: they are sanitized (`rules.clean_reason`), and a reason is one
line of at most `MAX_REASON` characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from scheduler.claims.result import NoClaim
from scheduler.claims.rules import clean_reason
from scheduler.gpus import FREE_GPU, LEFTOVER_GPUS, USABLE_VM
from scheduler.jobs import transition
from scheduler.placement import short_of, unsatisfiable_gang_reason, unsatisfiable_reason
from scheduler.states import JobStatus

MAX_REASON = 500
"""The most characters of a pending reason (`jobs.status_reason`, shown by `job list`)."""

NAMED_VMS = 3
"""The most VMs one reason names; the others are counted."""

_NAME_MAX = 64
_HEALTH_MAX = 120


@dataclass(frozen=True)
class VmView:
    """One VM as a pending reason sees it: its GPUs and what keeps the unheld ones out."""

    id: int
    name: str
    status: str
    draining: bool
    size: int
    """Every GPU row of the VM."""
    free: int
    """GPUs a claim could take now."""
    spare: int
    """GPUs no job holds (free, or kept out of use for a cause below)."""
    unhealthy: int = 0
    health_reason: str | None = None
    drained: int = 0
    foreign_busy: int = 0
    leftover: int = 0

    def causes(self) -> list[str]:
        """Why its spare GPUs are not all free, in words."""
        out = []
        if self.draining:
            out.append("draining")
        if self.status != "healthy":
            out.append("not polled yet" if self.status == "unknown" else clean_reason(self.status))
        if self.unhealthy:
            health = clean_reason(self.health_reason or "", _HEALTH_MAX)
            out.append(f"{_gpus(self.unhealthy)} unhealthy" + (f": {health}" if health else ""))
        if self.drained:
            out.append(f"{_gpus(self.drained)} drained")
        if self.foreign_busy:
            out.append(f"{_gpus(self.foreign_busy)} busy with a process rlfleet did not start")
        if self.leftover:
            out.append(f"{_gpus(self.leftover)} held by a leftover attempt")
        return out


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


# -- headlines ----------------------------------------------------------------------------


def pending_reason(need: int, largest_free: int) -> str:
    """Why a single-node job waits, in the words `job list` shows."""
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


def gang_wait_reason(demands: Sequence[int], free_by_vm: Mapping[int, int]) -> str:
    """Why a gang with these per-node demands waits on VMs with these free GPUs (the
    words of `gang_pending_reason` when every node needs the same)."""
    short = short_of(dict(free_by_vm), list(demands))
    n, need, have = short or (len(demands), max(demands), len(free_by_vm))
    if len(set(demands)) == 1:
        return gang_pending_reason(len(demands), need, have)
    return (
        f"needs {len(demands)} VMs with {_demands_text(demands)} free GPUs; "
        f"{have} VM(s) have {need} free, {n} needed"
    )


def gang_never_reason(demands: Sequence[int], sizes: Mapping[int, int]) -> str | None:
    """Why a gang can never run on VMs of these sizes (None when it could): the words of
    `unsatisfiable_gang_reason` when every node needs the same."""
    short = short_of(dict(sizes), list(demands))
    if short is None:
        return None
    n, need, have = short
    if len(set(demands)) == 1:
        return unsatisfiable_gang_reason(len(demands), need, have)
    return (
        f"needs {len(demands)} VMs with {_demands_text(demands)} GPUs; "
        f"only {have} VM(s) have {need} or more, {n} needed"
    )


# -- the whole reason ---------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """What a pending reason reads of the fleet: every VM's size and free GPUs, and the
    first few VMs (most spare GPUs first) whose kept-out GPUs would give a node its GPUs."""

    sizes: Mapping[int, int]
    free: Mapping[int, int]
    kept_out: Sequence[VmView] = ()
    kept_out_total: int = 0
    """How many VMs there are like `kept_out`'s (it holds the first `NAMED_VMS`)."""

    @classmethod
    def of(cls, vms: Sequence[VmView], need: int) -> Fleet:
        """The fleet of these VMs, for a node needing `need` GPUs."""
        kept = sorted((v for v in vms if v.free < need <= v.spare), key=_named_first)
        return cls(
            {v.id: v.size for v in vms},
            {v.id: v.free for v in vms if v.free},
            tuple(kept[:NAMED_VMS]),
            len(kept),
        )


def _named_first(vm: VmView) -> tuple[int, int]:
    return (-vm.spare, vm.id)


def short_need(demands: Sequence[int], free_by_vm: Mapping[int, int] | None) -> int:
    """The GPUs a node needs that too few VMs have free: the VMs worth naming are those
    that would have them but for a cause (a single-node job: its one demand)."""
    if len(demands) == 1 or free_by_vm is None:
        return max(demands)
    short = short_of(dict(free_by_vm), list(demands))
    return short[1] if short else max(demands)


def explain(
    demands: Sequence[int], fleet: Fleet, free_by_vm: Mapping[int, int] | None = None
) -> str:
    """Why a job needing `demands` (GPUs per rank, rank 0 first) waits on this fleet:
    the headline, then the VMs whose kept-out GPUs would have let it run. `free_by_vm`:
    the free counts the claim saw (default: the fleet's)."""
    free = dict(free_by_vm if free_by_vm is not None else fleet.free)
    if len(demands) == 1:
        largest_vm = max(fleet.sizes.values(), default=0)
        if demands[0] > largest_vm:
            return clean_reason(unsatisfiable_reason(demands[0], largest_vm), MAX_REASON)
        head = pending_reason(demands[0], max(free.values(), default=0))
    else:
        never = gang_never_reason(demands, fleet.sizes)
        if never is not None:
            return clean_reason(never, MAX_REASON)
        head = gang_wait_reason(demands, free)
    return clean_reason(head + _kept_out(short_need(demands, free), fleet), MAX_REASON)


def _kept_out(need: int, fleet: Fleet) -> str:
    """` (vm-a: 2 GPUs unhealthy: …; vm-b: draining)`: the VMs that would have `need` GPUs
    free but for a cause, most spare first; '' when none."""
    named = [v for v in fleet.kept_out if v.free < need <= v.spare and v.causes()]
    if not named:
        return ""
    parts = [f"{clean_reason(v.name, _NAME_MAX)}: {', '.join(v.causes())}" for v in named]
    more = max(fleet.kept_out_total, len(parts)) - len(parts)
    return " (" + "; ".join(parts) + (f"; {more} more VM(s)" if more > 0 else "") + ")"


FLEET_SQL = text(
    f"""
WITH {LEFTOVER_GPUS}, per_vm AS MATERIALIZED (
    SELECT v.id, v.name, v.status, v.draining, count(*) AS size,
           count(*) FILTER (WHERE {USABLE_VM} AND {FREE_GPU}) AS free,
           count(*) FILTER (WHERE g.job_id IS NULL) AS spare,
           count(*) FILTER (WHERE g.job_id IS NULL AND NOT g.healthy) AS unhealthy,
           min(g.health_reason) FILTER (WHERE g.job_id IS NULL AND NOT g.healthy)
               AS health_reason,
           count(*) FILTER (WHERE g.job_id IS NULL AND g.drained) AS drained,
           count(*) FILTER (WHERE g.job_id IS NULL AND g.foreign_busy) AS foreign_busy,
           count(*) FILTER (WHERE g.job_id IS NULL AND EXISTS (
               SELECT 1 FROM leftover_gpus b
               WHERE b.vm_id = g.vm_id AND (b.uuid = g.uuid OR b.index = g.index))) AS leftover
    FROM vms v JOIN gpus g ON g.vm_id = v.id
    GROUP BY v.id
), fleet AS (
    SELECT array_agg(id ORDER BY id) AS ids, array_agg(size ORDER BY id) AS sizes,
           array_agg(free ORDER BY id) AS frees
    FROM per_vm
), named AS (
    -- The VMs whose GPUs no job holds would give a node its GPUs, were they all free.
    SELECT p.*, count(*) OVER () AS total FROM per_vm p
    WHERE p.free < :need AND p.spare >= :need
    ORDER BY p.spare DESC, p.id LIMIT :named
)
SELECT f.ids, f.sizes, f.frees, n.* FROM fleet f LEFT JOIN named n ON true
"""
)
"""Every VM's size and free GPUs (as arrays, one row), beside the first `:named` VMs whose
kept-out GPUs would give a node of `:need` GPUs its GPUs, with what keeps them out."""


async def load_fleet(conn: AsyncConnection | AsyncSession, need: int) -> Fleet:
    """The fleet as `explain` reads it for a node of `need` GPUs (caller's transaction)."""
    rows = (await conn.execute(FLEET_SQL, {"need": need, "named": NAMED_VMS})).all()
    first = rows[0]
    ids = [int(i) for i in first.ids or ()]
    return Fleet(
        dict(zip(ids, (int(n) for n in first.sizes or ()), strict=True)),
        {i: int(n) for i, n in zip(ids, first.frees or (), strict=True) if n},
        tuple(_view(r) for r in rows if r.id is not None),
        int(first.total or 0),
    )


def _view(r: Any) -> VmView:
    return VmView(
        int(r.id),
        str(r.name),
        str(r.status),
        bool(r.draining),
        int(r.size),
        int(r.free),
        int(r.spare),
        int(r.unhealthy),
        r.health_reason if isinstance(r.health_reason, str) else None,
        int(r.drained),
        int(r.foreign_busy),
        int(r.leftover),
    )


async def waiting_reason(
    conn: AsyncConnection, demands: Sequence[int], free_by_vm: Mapping[int, int] | None = None
) -> str:
    """Why a job needing `demands` (GPUs per rank: its shape's `demands`, or what the
    claim placed) fits nowhere now: `explain` over the fleet loaded now (one query);
    `free_by_vm`: the free counts the claim saw, when it counted them."""
    fleet = await load_fleet(conn, short_need(demands, free_by_vm))
    return explain(demands, fleet, free_by_vm)


async def park(conn: AsyncConnection, job_id: int, reason: str, actor: str) -> NoClaim:
    """`queued → pending` with `reason` (the job's row is locked by the caller)."""
    reason = clean_reason(reason, MAX_REASON)
    moved = await transition(
        AsyncSession(bind=conn),  # a session over the connection joins its transaction
        job_id,
        expected=JobStatus.QUEUED,
        to=JobStatus.PENDING,
        reason=reason,
        actor=actor,
        values={"status_reason": reason},
    )
    return NoClaim(job_id, JobStatus.PENDING.value, reason, moved_to_pending=moved)
