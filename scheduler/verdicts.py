"""What a probed attempt's state means for its job: pure decisions, no I/O.

The GPU poller probes every live attempt (`scheduler.remote.RemoteJobState`) and asks
`job_verdict` what to do with its job: leave it, complete it, or fail it with a
`FailureReason` (`classify_failure`, from the exit code and the end of the log).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scheduler.remote.launch import ENTRY_BROKEN_MARK
from scheduler.remote.layout import Attempt
from scheduler.remote.probe import RemoteJobState
from scheduler.remote.store import FINAL_REFUSED_EXIT, STORE_ERROR_EXIT
from scheduler.remote.watchdog import FENCED_FILE, is_fence_note
from scheduler.retry import VM_FAULT_EXITS
from scheduler.states import FailureReason, JobStatus
from trlspec.exits import DOWNLOAD_FAILED_PREFIX, ERROR_PREFIX, EXIT_TRANSIENT, EXIT_USAGE

_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError", re.IGNORECASE)
_SIGNAL = re.compile(r"\b(SIG(KILL|TERM|INT|HUP|SEGV|ABRT|BUS)|Killed|Terminated)\b")


def classify_failure(
    exit_code: int | None,
    log_tail: str = "",
    *,
    cannot_start: bool = False,
    store_error: bool = False,
) -> FailureReason | None:
    """Why an attempt failed, from its exit code and the end of its log; None for success.

    64 is permanent (bad arguments or input); 126/127 with `cannot_start` (the wrapper's
    own check found that the VM's python or entrypoint cannot run) is `launch_failed`;
    75 is what its error line names (`transient_cause`), else an out-of-memory message
    with any exit is `oom`; an exit of 128+N or a signal name at the end
    of the log is `killed`; no exit code at all is `vanished`; anything else non-zero,
    126 and 127 of the training itself included (a reward calling a tool the VM lacks, a
    job that broke its own PATH), is `exit_nonzero`: the job's, counted against its
    retries (docs/invariants.md, invariant 9). `STORE_ERROR_EXIT` with `store_error` (the
    wrapper could not use the job's store) is `store_error`.
    """
    if exit_code is None:
        return FailureReason.VANISHED
    if exit_code == 0:
        return None
    if exit_code in VM_FAULT_EXITS and cannot_start:
        return FailureReason.LAUNCH_FAILED
    if exit_code == STORE_ERROR_EXIT and store_error:
        return FailureReason.STORE_ERROR
    if exit_code == EXIT_USAGE:
        return FailureReason.CONFIG_ERROR
    if exit_code == EXIT_TRANSIENT:
        return transient_cause(log_tail)
    if _OOM.search(log_tail):
        return FailureReason.OOM
    if exit_code >= 128 or exit_code < 0 or _SIGNAL.search(log_tail[-400:]):
        return FailureReason.KILLED
    return FailureReason.EXIT_NONZERO


def transient_cause(log_tail: str) -> FailureReason:
    """Why train_grpo.py exited 75, from its last error line: `download_failed` (a hub
    download), `oom` (CUDA out of memory), else `transient` (a reward's timeout, a refused
    connection). With no error line (an older training), an OOM message anywhere is `oom`."""
    errors = [line for line in log_tail.splitlines() if line.startswith(ERROR_PREFIX)]
    last = errors[-1] if errors else log_tail
    if errors and last.startswith(DOWNLOAD_FAILED_PREFIX):
        return FailureReason.DOWNLOAD_FAILED
    if _OOM.search(last):
        return FailureReason.OOM
    return FailureReason.TRANSIENT


@dataclass(frozen=True)
class LiveJob:
    """A job in starting/running on a VM, as loaded at the start of a sweep."""

    id: int
    vm_id: int
    status: str
    attempt_number: int
    """The attempt the job row names (its `attempt`), probed on this VM."""
    remote_pid: int | None
    attempt: Attempt | None = None
    """The attempt and where its files are; None for a row with no launch token (not
    probed)."""
    rank: int = 0
    """Which node of a multi-node job this is (0 for a single-node job)."""
    nodes: int = 1
    """How many nodes the job spans: above 1, this attempt is one rank of several."""


@dataclass(frozen=True)
class JobVerdict:
    """What the poller will do with a live job: move it to `to` and why."""

    job: LiveJob
    to: JobStatus
    exit_code: int | None
    failure_reason: FailureReason | None
    reason: str
    vm_error: str | None = None
    """Set when the VM cannot run training at all (the wrapper's own check failed with
    126/127): the VM is marked with it."""


def launch_error_line(log_tail: str) -> str:
    """The line of an attempt's log that says why training could not start: the wrapper's
    own verdict, else the last line before its closing one."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    marked = [line for line in lines if line.startswith(ENTRY_BROKEN_MARK)]
    rest = [line for line in lines if not line.startswith("rlfleet: attempt ended")]
    line = _SHELL_PREFIX.sub("", (marked or rest or ["no output"])[-1])
    # The end says why ("Permission denied"); a long path in front may go.
    return line if len(line) <= 300 else line[:80] + " … " + line[-217:]


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d{1,4})\b", re.DOTALL
)
"""The first failed process's exit code in torch's launcher report at the end of the log."""


def launcher_exit(exit_code: int | None, log_tail: str = "") -> int | None:
    """The exit code an attempt ended with, as the training meant it.

    Several processes (`accelerate launch`, torchrun underneath) exit 1 whenever one of them
    fails, and name the first failure's own code in the report that ends the log ("Root
    Cause (first observed failure): … exitcode : 64"). That code is the attempt's, so that
    a bad argument is still a config error (never retried) and 75 still retryable; a
    process killed by signal N (reported as -N) is 128+N. Anything else is kept as it is
    (126/127 too: the launcher's own 1 is the job's failure either way)."""
    if exit_code != 1:
        return exit_code
    found = _ROOT_CAUSE.search(log_tail)
    if found is None:
        return exit_code
    code = int(found.group(1))
    if code < 0:
        code = 128 - code
    if not 1 < code < 256 or code in VM_FAULT_EXITS:
        return exit_code
    return code


_SHELL_PREFIX = re.compile(r"\S*/launch\.sh: (?:line )?\d+: ")
"""How sh starts its own error lines (`/home/u/.rlfleet/…/launch.sh: 61: `): noise."""


def job_verdict(job: LiveJob, state: RemoteJobState | None) -> JobVerdict | None:
    """The move a probed job needs, or None while it runs or is still being launched.

    A `running` row whose launch left no pid file, with no pid recorded (a row written by
    hand, or by a bug), fails as `vanished`, once, with a reason: nothing else would ever
    resolve it, and it would hold its GPUs for good (`untracked_verdict` for a row with
    no launch token at all)."""
    if state is None or state.state == "running":
        return None
    if state.state == "unknown" and job.remote_pid is None:
        if job.status == JobStatus.RUNNING.value and job.nodes == 1:
            why = "running without a pid: its launch was never confirmed on the VM"
            return JobVerdict(job, JobStatus.FAILED, None, FailureReason.VANISHED, why)
        return None  # launching: no pid file yet; the lease expiry handles a launch that died
    bad = bad_control_file(state)
    if bad is not None:
        return JobVerdict(job, JobStatus.FAILED, state.exit_code, FAILED_CONTROL, bad)
    if state.state == "exited" and state.fenced is not None:
        # Its watchdog stopped it: the scheduler had lost contact, not the job's fault.
        return JobVerdict(
            job,
            JobStatus.FAILED,
            state.exit_code,
            FailureReason.NODE_LOST,
            fenced_reason(job.attempt_number, state.fenced),
        )
    if state.state == "exited":
        code = launcher_exit(state.exit_code, state.log_tail)
        failure = classify_failure(
            code, state.log_tail, cannot_start=state.cannot_start, store_error=state.store_error
        )
        if failure is None:
            return JobVerdict(job, JobStatus.COMPLETED, 0, None, "exited 0")
        if failure == FailureReason.LAUNCH_FAILED:
            line = launch_error_line(state.log_tail)
            why = f"{failure.value}: exit {code}: {line}"
            return JobVerdict(job, JobStatus.FAILED, code, failure, why, line)
        if failure == FailureReason.STORE_ERROR:
            line = store_line(state.log_tail)
            why = f"store_error: {line or 'the store could not be used'}"
            return JobVerdict(job, JobStatus.FAILED, code, failure, why)
        if code == FINAL_REFUSED_EXIT and _FINAL_REFUSED in (line := store_line(state.log_tail)):
            # The training exited 0; its final upload failed on a store that answered: the
            # job's failure (a file it made unreadable, a place it blocked), counted.
            why = f"exited 0, but {line}"
            return JobVerdict(job, JobStatus.FAILED, code, failure, why)
        why = f"exited {code}"
        if code != state.exit_code:
            why = f"exited {state.exit_code}: its first failed process exited {code}"
        group_line = group_failure_line(state.log_tail)
        if group_line:
            why = f"{why}: {group_line}"
        return JobVerdict(job, JobStatus.FAILED, code, failure, why)
    why = "no pid file" if state.state == "unknown" else "process gone without an exit code"
    return JobVerdict(job, JobStatus.FAILED, None, FailureReason.VANISHED, why)


FAILED_CONTROL = FailureReason.BAD_CONTROL_FILE


def bad_control_file(state: RemoteJobState) -> str | None:
    """Why an ended attempt's control files cannot be the scheduler's, or None: an
    `exit_code` that is no exit code a wrapper writes, a `fenced_reason` that is not its
    watchdog's line. Either is in a directory the job can write, so the job wrote it: its
    failure, counted against its retries (issue 29, point 7), never a lost node (retried
    uncounted) nor a completion (the scheduler cannot tell whether the attempt was cut
    short). What the file held is not repeated (it is the job's text)."""
    if state.state != "exited":
        return None
    if state.bad_exit_code:
        return f"{FAILED_CONTROL.value}: its exit_code file holds no exit code (0-255)"
    if state.fenced is not None and not is_fence_note(state.fenced):
        return (
            f"{FAILED_CONTROL.value}: its {FENCED_FILE} ({len(state.fenced)} characters read)"
            " is not a line its watchdog writes"
        )
    return None


_FINAL_REFUSED = "the final outputs could not be uploaded and the store answered"
"""What the store agent says when `finish --final` ends with `FINAL_REFUSED_EXIT`."""


def store_line(log_tail: str) -> str:
    """The store agent's last line in the log (`rlfleet-store: …`), without its prefix."""
    said = [ln.strip() for ln in log_tail.splitlines() if "rlfleet-store:" in ln]
    return said[-1].split("rlfleet-store:", 1)[1].strip()[:300] if said else ""


def untracked_verdict(job: LiveJob) -> JobVerdict | None:
    """The move of a live job the poller cannot probe (`job.attempt` is None: no launch token,
    so no directory anyone may look at): a `running` one fails as `vanished`, once, saying
    why; a `starting` one is left to its lease (`claims.leases.expire_leases`)."""
    if job.attempt is not None or job.status != JobStatus.RUNNING.value:
        return None
    why = "running without a launch token: its attempt cannot be found on the VM"
    return JobVerdict(job, JobStatus.FAILED, None, FailureReason.VANISHED, why)


_GROUP_WHY = re.compile(
    r"^rlfleet-group: (role \S+ (?:(?:not ready after \d+s|failed \(exit -?\d+\)"
    r"|exited while a primary role runs|stopped answering its readiness check for \d+s)"
    r"(?: after \d+ restarts?)?(?=$|; stopping the group$)|cannot start: .*))"
)
"""A line that ended the group; not one about a role restarted in place (`…; stopping
it`, `…; restarting it in Ns`)."""


def group_failure_line(log_tail: str) -> str | None:
    """Why a job group's supervisor stopped the group, from the end of its log (the first
    such line: the cause, not the roles it stopped after it), cut to 300 characters."""
    for line in log_tail.splitlines():
        match = _GROUP_WHY.match(line.strip())
        if match:
            return match.group(1).split("; stopping")[0][:300]
    return None


_GROUP_DETAIL = re.compile(r"^exited -?\d+: (role \S+ .*)$")


def group_reason_detail(reason: str | None) -> str | None:
    """The role part of a failed job group's reason (`exited 94: role reward not ready
    after 120s` → `role reward not ready after 120s`), or None."""
    match = _GROUP_DETAIL.match(reason or "")
    return match.group(1) if match else None


def fenced_reason(attempt: int, why: str) -> str:
    """The event reason of an attempt its watchdog fenced off. It starts with `node_lost`
    so that it counts towards the job's lost-node limit like any other lost node."""
    text = f"{FailureReason.NODE_LOST.value} (fenced): attempt {attempt} stopped by its watchdog"
    return f"{text}: {why}"[:500] if why else text
