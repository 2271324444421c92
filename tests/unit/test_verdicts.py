"""What a probed attempt's state means for its job, as tables: failure classes from exit
codes and log tails, and the move each probed state asks for."""

from __future__ import annotations

import pytest

from scheduler.remote.layout import Attempt
from scheduler.remote.probe import RemoteJobState
from scheduler.retry import counts_against_limit
from scheduler.states import FailureReason, JobStatus
from scheduler.verdicts import (
    LiveJob,
    classify_failure,
    job_verdict,
    launch_error_line,
    untracked_verdict,
)

OOM_LINE = (
    "train-grpo: error: CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total"
    " capacity of 79.11 GiB of which 1.2 GiB is free."
)
DOWNLOAD_LINE = (
    "'[Errno 111] Connection refused' thrown while requesting HEAD https://huggingface.co/x\n"
    "train-grpo: error: downloading tokenizer Qwen/Qwen2.5-0.5B failed: We couldn't connect"
    " to 'https://huggingface.co' to load the files, and couldn't find them in the cached files."
)


@pytest.mark.parametrize(
    ("exit_code", "log", "expected"),
    [
        (0, "", None),
        (0, "CUDA out of memory (recovered)", None),
        (64, "unknown reward function", FailureReason.CONFIG_ERROR),
        (64, "CUDA out of memory", FailureReason.CONFIG_ERROR),
        (75, "", FailureReason.TRANSIENT),
        # Exit 75 names its cause in train_grpo.py's error line (the real lines' shapes).
        (75, OOM_LINE, FailureReason.OOM),
        (75, DOWNLOAD_LINE, FailureReason.DOWNLOAD_FAILED),
        (75, f"{OOM_LINE}\nstep 3\n{DOWNLOAD_LINE}", FailureReason.DOWNLOAD_FAILED),
        (75, "train-grpo: error: reward function f raised TimeoutError", FailureReason.TRANSIENT),
        # Only exit 75 makes the line a cause: a job can print anything.
        (1, DOWNLOAD_LINE, FailureReason.EXIT_NONZERO),
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", FailureReason.OOM),
        (137, "CUDA out of memory", FailureReason.OOM),
        (137, "", FailureReason.KILLED),
        (143, "", FailureReason.KILLED),
        (-9, "", FailureReason.KILLED),
        (1, "step 10\nKilled", FailureReason.KILLED),
        (1, "Traceback ... ValueError", FailureReason.EXIT_NONZERO),
        (2, "", FailureReason.EXIT_NONZERO),
        (None, "", FailureReason.VANISHED),
        # The training's own 126/127 (a tool the VM lacks, a job's broken PATH) is the
        # job's, even when its log says what the wrapper says: a job can print anything.
        (126, "sh: 1: /opt/py: Permission denied", FailureReason.EXIT_NONZERO),
        (127, "exec: python3: not found", FailureReason.EXIT_NONZERO),
        (
            127,
            "rlfleet: training cannot start on this VM (exit 127): x",
            FailureReason.EXIT_NONZERO,
        ),
    ],
)
def test_failure_classification(
    exit_code: int | None, log: str, expected: FailureReason | None
) -> None:
    assert classify_failure(exit_code, log) == expected


@pytest.mark.parametrize("code", [126, 127])
def test_only_the_wrappers_own_check_makes_126_and_127_a_vm_fault(code: int) -> None:
    """With the wrapper's `cannot_start` mark, 126/127 is `launch_failed` (the VM's fault);
    any other exit code with that mark is still what it is."""
    assert classify_failure(code, cannot_start=True) == FailureReason.LAUNCH_FAILED
    assert classify_failure(code) == FailureReason.EXIT_NONZERO
    assert classify_failure(1, cannot_start=True) == FailureReason.EXIT_NONZERO


def test_a_trainings_exit_127_is_a_failure_of_the_job_not_of_its_vm() -> None:
    """An attempt whose training exited 127 (no wrapper mark) fails as exit_nonzero, which
    counts against the job's retries, and marks no VM."""
    tail = "sh: 1: exec: python3: not found\nrlfleet: attempt ended with exit code 127\n"
    verdict = job_verdict(RUNNING, RemoteJobState("exited", 127, tail))
    assert verdict is not None and verdict.failure_reason == FailureReason.EXIT_NONZERO
    assert verdict.vm_error is None and verdict.exit_code == 127
    assert counts_against_limit(verdict.failure_reason.value, verdict.exit_code)


INSTALLATION = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
RUNNING = LiveJob(id=1, vm_id=1, status="running", attempt_number=1, remote_pid=4242)
STARTING = LiveJob(id=1, vm_id=1, status="starting", attempt_number=1, remote_pid=None)


@pytest.mark.parametrize(
    ("job", "state", "to", "reason"),
    [
        (RUNNING, RemoteJobState("running"), None, None),
        (RUNNING, None, None, None),
        (STARTING, RemoteJobState("unknown"), None, None),
        (RUNNING, RemoteJobState("exited", 0), JobStatus.COMPLETED, None),
        (STARTING, RemoteJobState("exited", 0), JobStatus.COMPLETED, None),
        (RUNNING, RemoteJobState("exited", 3), JobStatus.FAILED, FailureReason.EXIT_NONZERO),
        (RUNNING, RemoteJobState("vanished"), JobStatus.FAILED, FailureReason.VANISHED),
        (RUNNING, RemoteJobState("unknown"), JobStatus.FAILED, FailureReason.VANISHED),
    ],
)
def test_job_verdicts(
    job: LiveJob,
    state: RemoteJobState | None,
    to: JobStatus | None,
    reason: FailureReason | None,
) -> None:
    verdict = job_verdict(job, state)
    assert (verdict.to if verdict else None) == to
    assert (verdict.failure_reason if verdict else None) == reason


def test_an_attempt_that_could_not_start_names_the_vm_problem() -> None:
    """Exit 127 with the wrapper's mark (its own check failed): launch_failed, the verdict
    line as the reason,
    and the same line for the VM (whose python or entrypoint is broken)."""
    tail = (
        "rlfleet: attempt started on vm0\n"
        "rlfleet: training cannot start on this VM (exit 127): No module named 'training'\n"
        "rlfleet: attempt ended with exit code 127\n"
    )
    verdict = job_verdict(RUNNING, RemoteJobState("exited", 127, tail, cannot_start=True))
    assert verdict is not None and verdict.failure_reason == FailureReason.LAUNCH_FAILED
    line = "rlfleet: training cannot start on this VM (exit 127): No module named 'training'"
    assert verdict.vm_error == line
    assert verdict.reason == f"launch_failed: exit 127: {line}"


def test_a_broken_vms_reason_keeps_why_whatever_the_path_in_front() -> None:
    """sh's own prefix (`…/launch.sh: 61: `) is dropped, and a line too long keeps its end,
    which says why: a deep home directory must not cut "Permission denied" off."""
    deep = "/home/" + "d" * 300
    tail = (
        f"rlfleet: training cannot start on this VM (exit 126): {deep}/.rlfleet/i/jobs/1/1-t/"
        f"launch.sh: 61: {deep}/python: Permission denied\n"
        "rlfleet: attempt ended with exit code 126"
    )
    line = launch_error_line(tail)
    assert line.startswith("rlfleet: training cannot start on this VM (exit 126): ")
    assert line.endswith("/python: Permission denied") and "launch.sh" not in line
    assert len(line) <= 300


# The end of a log where torch's launcher (under `accelerate launch`) reports that one of
# its two processes exited 64 and it stopped the other, as torch 2.13 prints it.
LAUNCHER_REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
training/train_grpo.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_22:51:18
  host      : gpu-1
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8509)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8509
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_22:51:18
  host      : gpu-1
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 8510)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


@pytest.mark.parametrize(
    ("exit_code", "first", "counted", "reason"),
    [
        (1, "64", 64, FailureReason.CONFIG_ERROR),
        (1, "75", 75, FailureReason.TRANSIENT),
        (1, "3", 3, FailureReason.EXIT_NONZERO),
        (1, "-9", 137, FailureReason.KILLED),
        # A process's 127 is not the VM's fault: only the wrapper's own check says that.
        (1, "127", 1, FailureReason.EXIT_NONZERO),
        (1, "99999", 1, FailureReason.EXIT_NONZERO),
        # Only the launcher's own exit 1 is read through: the wrapper's codes stand.
        (143, "64", 143, FailureReason.KILLED),
    ],
)
def test_a_launchers_exit_1_counts_as_its_first_failed_process(
    exit_code: int, first: str, counted: int, reason: FailureReason
) -> None:
    tail = LAUNCHER_REPORT.replace("{code}", first)
    verdict = job_verdict(
        LiveJob(7, 1, "running", 2, 4242), RemoteJobState("exited", exit_code, tail)
    )
    assert verdict is not None and verdict.to == JobStatus.FAILED
    assert (verdict.exit_code, verdict.failure_reason) == (counted, reason)


def test_a_plain_exit_1_stays_1() -> None:
    verdict = job_verdict(
        LiveJob(7, 1, "running", 2, 4242), RemoteJobState("exited", 1, "Traceback …\nValueError")
    )
    assert verdict is not None and (verdict.exit_code, verdict.reason) == (1, "exited 1")


def test_a_running_row_without_a_launch_token_or_a_pid_fails_once_as_vanished() -> None:
    """A `running` row the probe cannot look at (no token), or whose launch left no pid
    file though none was recorded, fails as vanished saying why; a `starting` one waits
    for its lease (which expires even when the row has none)."""
    no_token = untracked_verdict(RUNNING)
    assert no_token is not None and no_token.failure_reason == FailureReason.VANISHED
    assert "without a launch token" in no_token.reason
    assert untracked_verdict(STARTING) is None
    no_pid = LiveJob(1, 1, "running", 1, None, attempt=Attempt(INSTALLATION, 1, 1, "0" * 16))
    verdict = job_verdict(no_pid, RemoteJobState("unknown"))
    assert verdict is not None and "without a pid" in verdict.reason
    launching = LiveJob(1, 1, "starting", 1, None, attempt=Attempt(INSTALLATION, 1, 1, "0" * 16))
    assert job_verdict(launching, RemoteJobState("unknown")) is None
    assert job_verdict(STARTING, None) is None


def test_each_exit_75_cause_has_its_retry_class() -> None:
    """An OOM and an unnamed transient failure are the job's (counted); a hub download that
    failed is an outage of a service the job needs: retried, not counted."""
    assert counts_against_limit(classify_failure(75, OOM_LINE))
    assert counts_against_limit(classify_failure(75, ""))
    assert not counts_against_limit(classify_failure(75, DOWNLOAD_LINE))
