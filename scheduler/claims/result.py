"""What a claim returns: the GPUs taken for a job now `starting` (`Claim`, one `NodeClaim`
per rank of a multi-node job) or why nothing was taken (`NoClaim`), and the job's
environment as the launch will pass it (`job_env_pairs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.attempts.shape import JobShape
from scheduler.remote.layout import Attempt


@dataclass(frozen=True)
class NodeClaim:
    """One rank of a gang claim: the VM and GPUs it runs on."""

    rank: int
    vm_id: int
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    """GPUs taken for a job that is now `starting`, and what its launch needs."""

    job_id: int
    attempt: int
    vm_id: int
    gpu_indices: list[int]
    output_dir: str
    model: str = ""
    dataset: str = ""
    reward_functions: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    """The claimed GPUs' UUIDs, in the order of `gpu_indices`: what the attempt runs on."""
    installation: str = ""
    token: str = ""

    @property
    def attempt_ref(self) -> Attempt:
        """The claimed attempt and its directory name (docs/invariants.md, invariant 6)."""
        return Attempt(self.installation, self.job_id, self.attempt, self.token)

    env: tuple[tuple[str, str], ...] = ()
    nodes: tuple[NodeClaim, ...] = ()
    """Every rank of a multi-node job, rank 0 first (its VM and GPUs are `vm_id`,
    `gpu_indices`, `gpu_uuids`); empty for a single-node job."""
    store: str | None = None
    """The job's store URL (checked by `job_row_problem`); None: no store."""
    roles: dict[str, Any] | None = None
    """A job group's roles (`jobs.roles`, checked by `job_row_problem`); None for a job of
    one training role."""
    workdir: str | None = None
    """The digest of the job's workdir (`jobs.workdir_digest`, checked by
    `job_row_problem`); None for a job without one."""
    shape: JobShape | None = None
    """The job's shape (`attempts.shape`), read once from its row by the claim: what the
    launch runs where."""


@dataclass(frozen=True)
class NoClaim:
    """Nothing was claimed. `status` is the job's state now (None: no such job, or not
    known yet); `contended` means GPUs would fit but other claimers hold them locked, or
    another transaction holds the job's row: try again soon."""

    job_id: int
    status: str | None
    reason: str | None = None
    contended: bool = False
    moved_to_pending: bool = False
    waiting: bool = False
    """An earlier attempt of the job may still run (`leftover_may_run`): ask again once
    the requeue manager has killed it."""
    rejected: bool = False
    """The job row cannot be launched (`rowcheck.job_row_problem`): it failed just now."""


def job_env_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """A job row's `env` as (key, value) pairs; entries that are not string pairs a job may
    set (a row written by hand) are left out rather than trusted."""
    from scheduler.validate import env_key_problem

    if not isinstance(value, dict):
        return ()
    return tuple(
        (k, v)
        for k, v in sorted(value.items())
        if isinstance(k, str)
        and isinstance(v, str)
        and env_key_problem(k) is None
        and not any(c in v for c in "\r\n\0")
    )
