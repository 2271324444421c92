"""Which pending jobs to put back in the queue, and which to hold back: pure, no I/O.

The requeue manager loads the pending jobs and the free GPUs of each VM, asks
`plan_pending`, and moves the jobs it names back to `queued` (anti-starvation included:
see `plan_pending`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler.placement import could_ever_fit, place


class Gate(Protocol):
    """The claim-time rules as the planner asks them (`claims.rules.ClaimGate`): whether a
    job may claim, and that a job woken will take its GPUs."""

    def refusal(self, job_id: int) -> str | None:
        """None: the rules let job `job_id` claim; else why it waits."""

    def took(self, job_id: int) -> None:
        """Job `job_id` is woken to take its GPUs: later jobs must see them taken."""


@dataclass(frozen=True)
class PendingJob:
    """A pending job as the republish planner sees it (listed by priority, then id)."""

    id: int
    gpus: int
    priority: int
    waited_s: float
    """Seconds since the job was submitted: the age anti-starvation looks at."""
    since_pending_s: float
    """Seconds since it last entered `pending` (it was last looked at by a dispatcher)."""
    nodes: int = 1
    """VMs the job spans, `gpus` on each."""
    demands: tuple[int, ...] = ()
    """A job group over several VMs: each node's GPUs (`gpus` is then their sum)."""

    def node_demands(self) -> list[int]:
        """The GPUs each node needs."""
        return list(self.demands) if self.demands else [self.gpus] * self.nodes


@dataclass(frozen=True)
class PendingPlan:
    """Which pending jobs to announce again, why, and which are held back for a bigger one."""

    republish: list[tuple[int, str]]
    held_for: int | None = None
    """The starving job the held-back ones wait behind; None when nothing is held."""
    held: list[int] | None = None
    refused: list[tuple[int, str]] = field(default_factory=list)
    """The jobs a claim-time rule refuses, with the rule's words: not woken, whatever the
    free GPUs or the time they have waited."""


def plan_pending(
    jobs: list[PendingJob],
    free_by_vm: dict[int, int],
    *,
    recheck_after_s: float,
    pending_timeout_s: float,
    starvation_after_s: float,
    largest_vm: int | None = None,
    vm_sizes: list[int] | None = None,
    gate: Gate | None = None,
) -> PendingPlan:
    """Decide which pending jobs to put back in the queue this tick.

    Walking jobs by priority then submission order, a job is announced again when some
    VM has enough free GPUs for it (each fit uses up that VM's free count, so one free GPU
    wakes one job, not all of them), or when it has been pending `pending_timeout_s`
    whatever the reported capacity. Anti-starvation: once a job that does not fit has
    waited `starvation_after_s`, every job after it (equal or lower priority, submitted
    later) is held back, so finishing jobs free GPUs for it instead of being refilled by
    smaller ones. A job is not re-announced within `recheck_after_s` of its last look.
    Only a job that fits on some VM (`gpus <= largest_vm`, the most GPUs one VM has; None:
    unknown, every job may fit) holds others back: waiting for one that can never run
    would stall the whole queue.

    A multi-node job (`nodes` > 1) fits when `nodes` different VMs have `gpus` free each
    (the fullest are used up, as the gang claim would); it holds others back only when
    `vm_sizes` (the GPU count of every VM; None: unknown) has `nodes` VMs big enough.

    A job the claim-time rules refuse (`gate`) is never woken, holds nothing back and is
    listed in `refused` with the rule's words; a job woken counts against the rules for
    the jobs after it, as a claim's batch does.
    """
    free = dict(free_by_vm)
    out: list[tuple[int, str]] = []
    refused: list[tuple[int, str]] = []
    for i, job in enumerate(jobs):
        why = gate.refusal(job.id) if gate is not None else None
        if why is not None:
            refused.append((job.id, why))
            continue
        placed = place(free, job.node_demands())
        if placed is not None:
            for vm, need in placed:
                free[vm] -= need
            if gate is not None:
                gate.took(job.id)
            if job.since_pending_s >= recheck_after_s:
                out.append((job.id, "capacity"))
            continue
        if job.since_pending_s >= pending_timeout_s:
            out.append((job.id, "timeout"))
        satisfiable = _satisfiable(job, largest_vm, vm_sizes)
        if satisfiable and job.waited_s >= starvation_after_s:
            held = [j.id for j in jobs[i + 1 :]]
            return PendingPlan(out, job.id if held else None, held or None, refused)
    return PendingPlan(out, refused=refused)


def _satisfiable(job: PendingJob, largest_vm: int | None, vm_sizes: list[int] | None) -> bool:
    """Whether the fleet as it is could ever run `job` (unknown sizes: assume it could)."""
    if vm_sizes is not None:
        return could_ever_fit(vm_sizes, job.node_demands())
    return largest_vm is None or (job.nodes == 1 and job.gpus <= largest_vm)
