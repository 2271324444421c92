"""What one poller sweep holds: each VM as loaded (its GPU rows and the ranks of live
attempts it runs), what probing it gave, and the sweep's counts. Plain data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.gpu_health import Health, Step, step
from scheduler.poll import PollResult
from scheduler.transport import VMTarget
from scheduler.verdicts import LiveJob


@dataclass
class GpuRow:
    """A GPU row as loaded; rows are keyed by UUID (docs/invariants.md, invariant 8)."""

    uuid: str
    job_id: int | None
    values: tuple[Any, ...]
    """(index, name, memory_total_mb, memory_used_mb, utilization_pct, healthy, foreign_busy)"""
    health: Health = field(default_factory=Health)
    """The GPU's own health as stored (`scheduler.gpu_health`)."""


@dataclass
class VMState:
    """One VM as loaded at the start of a sweep."""

    target: VMTarget
    status: str
    consecutive_failures: int
    launch_error: str | None = None
    gpus: dict[str, GpuRow] = field(default_factory=dict)
    """By UUID."""
    jobs: list[LiveJob] = field(default_factory=list)


@dataclass
class Outcome:
    """What probing one VM gave: a parsed poll, or the transport error."""

    vm: VMState
    result: PollResult | None = None
    error: str | None = None
    finished: set[int] = field(default_factory=set)
    """Jobs on this VM that the sweep moved to an end state (their GPUs freed)."""
    launch_error: str | None = None
    """Why training cannot start on the VM, as an attempt that ended this sweep said."""
    health: dict[str, Step] | None = None
    """Each GPU's health after this poll, by UUID, judged once (`judge`, when the inventory
    writes what the poll saw) and read by whatever else asks (`gpu_faults`); None: not
    judged (no answer)."""


def judge(vm: VMState, result: PollResult) -> dict[str, Step]:
    """Each GPU's health after this poll (`gpu_health.step` from its row's): the GPUs
    nvidia-smi listed, and those of the VM's rows it no longer lists (lost). Pure."""
    judged = {
        gpu.uuid: step(vm.gpus[gpu.uuid].health if gpu.uuid in vm.gpus else Health(), gpu)
        for gpu in result.gpus
    }
    for uuid, row in vm.gpus.items():
        if uuid not in judged:
            judged[uuid] = step(row.health, None)
    return judged


@dataclass
class SweepStats:
    """Counts of one sweep, for logs and tests."""

    vms: int = 0
    reachable: int = 0
    unhealthy: int = 0
    failed: int = 0
    jobs_finished: int = 0
    silent: int = 0
    """VMs whose poll was still out when the sweep ended."""
    polled: int = 0
    """Polls recorded (the VMs this poller holds that answered or failed)."""
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """This process's CPU time during the sweep (what a poller on a host of its own costs)."""
