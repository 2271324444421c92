"""The job and VM state vocabularies, and the table of allowed job moves.

This module is pure: no I/O. `scheduler.jobs.transition` performs moves against the
database using `ALLOWED_MOVES` as the only authority on what may follow what.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """Where a job is in its life. The values are stored in `jobs.status`."""

    QUEUED = "queued"
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """True for states no move leaves (`failed` can still be retried, so it is not)."""
        return self in FINAL_STATES

    @property
    def is_live(self) -> bool:
        """True while the job may hold GPUs or have a process on a VM."""
        return self in LIVE_STATES


FINAL_STATES = frozenset({JobStatus.COMPLETED, JobStatus.CANCELLED})
LIVE_STATES = frozenset({JobStatus.STARTING, JobStatus.RUNNING})

# Every allowed move. Anything not listed here is refused by `check_move`.
# queued/pending/failed -> completed: an earlier attempt, given up for lost, turns out to
# have exited 0 when its VM answers again ("one success is enough", docs/decisions.md).
ALLOWED_MOVES: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset(
        {
            JobStatus.PENDING,
            JobStatus.STARTING,
            JobStatus.COMPLETED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
        }
    ),
    JobStatus.PENDING: frozenset(
        {
            JobStatus.QUEUED,
            JobStatus.STARTING,
            JobStatus.COMPLETED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
        }
    ),
    # starting -> queued: the claim's lease expired before the launch was confirmed.
    # starting -> completed/failed: the process ended before its pid was recorded.
    JobStatus.STARTING: frozenset(
        {
            JobStatus.RUNNING,
            JobStatus.QUEUED,
            JobStatus.COMPLETED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
        }
    ),
    JobStatus.RUNNING: frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED}),
    # failed -> queued is a retry (automatic or `rlfleet job retry`); failed -> cancelled
    # is the user saying "no more retries".
    JobStatus.FAILED: frozenset({JobStatus.QUEUED, JobStatus.COMPLETED, JobStatus.CANCELLED}),
    JobStatus.COMPLETED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}

# The timestamp column stamped when a job enters each state.
STATE_TIMESTAMP: dict[JobStatus, str] = {
    JobStatus.QUEUED: "queued_at",
    JobStatus.PENDING: "pending_at",
    JobStatus.STARTING: "starting_at",
    JobStatus.RUNNING: "running_at",
    JobStatus.COMPLETED: "finished_at",
    JobStatus.FAILED: "finished_at",
    JobStatus.CANCELLED: "finished_at",
}


class IllegalMove(ValueError):
    """A job state move that the state machine does not allow."""


def is_allowed(src: JobStatus, dst: JobStatus) -> bool:
    """Whether a job may move from `src` to `dst`."""
    return dst in ALLOWED_MOVES[JobStatus(src)]


def check_move(src: JobStatus, dst: JobStatus) -> None:
    """Raise `IllegalMove` unless `src -> dst` is an allowed move."""
    if not is_allowed(src, dst):
        raise IllegalMove(f"a job cannot move from {src} to {dst}")


class VMStatus(StrEnum):
    """Reachability of a VM as the poller last saw it. Draining is a separate flag."""

    UNKNOWN = "unknown"  # added, never polled yet
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # answers SSH, but nvidia-smi failed: its GPUs are not offered
    UNREACHABLE = "unreachable"


class RetryDecision(StrEnum):
    """What the requeue manager decided about a failed job (`jobs.retry_decision`)."""

    RETRY = "retry"  # at `next_attempt_at`
    GIVE_UP = "give_up"  # stays failed; `status_reason` says why


class FailureReason(StrEnum):
    """Why a job failed. Each reason has its `RetryClass` (`FAILURE_RETRY`), from which the
    requeue policy (`scheduler.retry`) decides whether to retry: a new reason is added here,
    with its class, and set by the code that detects it (a probed attempt's:
    `verdicts.classify_failure`)."""

    CONFIG_ERROR = "config_error"  # train_grpo.py exit 64: permanent
    OOM = "oom"  # CUDA out of memory in the log (exit 75 from train_grpo.py, or any exit)
    DOWNLOAD_FAILED = "download_failed"  # exit 75: a hub download failed (its error line)
    TRANSIENT = "transient"  # exit 75 naming no known cause (a reward's timeout, a refusal)
    EXIT_NONZERO = "exit_nonzero"
    KILLED = "killed"  # ended by a signal
    LAUNCH_FAILED = "launch_failed"  # not started; exit 126/127: the VM's python/entrypoint
    NODE_LOST = "node_lost"
    VM_REMOVED = "vm_removed"  # `vm remove --force` while it ran
    VANISHED = "vanished"  # process gone without an exit code
    HUNG = "hung"  # running, its step unchanged for the job's hang timeout: stopped
    STARTUP_TIMEOUT = "startup_timeout"  # running, no first step within its startup timeout
    STORE_ERROR = "store_error"  # the job's store unreachable or refused at the attempt's start
    GPU_FAILED = "gpu_failed"  # its GPU was lost or requires a reset: stopped, retried elsewhere
    BAD_CONTROL_FILE = "bad_control_file"
    """A control file of the attempt (its exit code, its watchdog's fence note) holds what
    the scheduler never writes: the job wrote it (same account), its failure, counted."""


class RetryClass(StrEnum):
    """How the requeue policy treats a failure reason."""

    PERMANENT = "permanent"  # never retried
    COUNTED = "counted"  # retried while retries are left, with backoff
    MACHINE_FAULT = "machine_fault"  # the VM's fault: retried at once, not counted
    MACHINE_FAULT_ON_VM_EXIT = "machine_fault_on_vm_exit"
    """The VM's fault with exit 126/127 (its python or entrypoint cannot run), else counted."""
    OUTAGE = "outage"
    """A service the job needs is down (its store): retried with backoff, not counted
    against its retries; like the machine faults, within `RetryPolicy.uncounted_limit`."""


FAILURE_RETRY: dict[FailureReason, RetryClass] = {
    FailureReason.CONFIG_ERROR: RetryClass.PERMANENT,
    FailureReason.OOM: RetryClass.COUNTED,
    FailureReason.DOWNLOAD_FAILED: RetryClass.OUTAGE,
    FailureReason.TRANSIENT: RetryClass.COUNTED,
    FailureReason.EXIT_NONZERO: RetryClass.COUNTED,
    FailureReason.KILLED: RetryClass.COUNTED,
    FailureReason.LAUNCH_FAILED: RetryClass.MACHINE_FAULT_ON_VM_EXIT,
    FailureReason.NODE_LOST: RetryClass.MACHINE_FAULT,
    FailureReason.VM_REMOVED: RetryClass.MACHINE_FAULT,
    FailureReason.VANISHED: RetryClass.COUNTED,
    FailureReason.HUNG: RetryClass.COUNTED,
    FailureReason.STARTUP_TIMEOUT: RetryClass.COUNTED,
    FailureReason.STORE_ERROR: RetryClass.OUTAGE,
    FailureReason.GPU_FAILED: RetryClass.MACHINE_FAULT,
    FailureReason.BAD_CONTROL_FILE: RetryClass.COUNTED,
}
"""Every failure reason's retry class (`tests/unit/test_retry.py` checks none is missing)."""
