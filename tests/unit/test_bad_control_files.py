"""A job's own files cannot buy it retries (issue 29, point 7): the bookkeeping the poller
reads from an attempt directory (the watchdog's fence note, the exit code) is checked
before use, and a bad one is the job's failure, counted against its retries."""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from scheduler.remote.layout import Attempt
from scheduler.remote.probe import parse_status, status_probe
from scheduler.remote.watchdog import fence_note, is_fence_note
from scheduler.retry import (
    DEFAULT_POLICY,
    Failure,
    GiveUp,
    Retry,
    RetryPolicy,
    counts_against_limit,
    decide,
)
from scheduler.states import FailureReason, JobStatus
from scheduler.verdicts import LiveJob, job_verdict

RUNNING = LiveJob(id=4, vm_id=1, status="running", attempt_number=1, remote_pid=4242)
NOW = datetime(2026, 11, 27, tzinfo=UTC)
INSTALLATION = "6f1c1a8e-0000-4000-8000-000000000000"


def _probe(fenced: str | None, code: str = "0") -> str:
    lines = [f"rlfleet-job 4 1 exited {code}", "rlfleet-log 4 1 rlfleet: attempt ended", ""]
    if fenced is not None:
        lines.insert(0, f"rlfleet-fenced 4 1 {fenced}")
    return "\n".join(lines)


def test_the_watchdogs_own_note_is_a_lost_node() -> None:
    note = fence_note(31, 30)
    assert is_fence_note(note)
    verdict = job_verdict(RUNNING, parse_status(_probe(note, "143"))[(4, 1)])
    assert verdict is not None and verdict.failure_reason == FailureReason.NODE_LOST


@pytest.mark.parametrize(
    "garbage",
    [
        "A" * 300,  # what `head -c 300` keeps of a 1 MB garbage file
        "lease not renewed for 99999999999999999999999s (fence after 30s): the scheduler lost"
        " contact with this VM",
        "lease not renewed for 5s (fence after 30s): the scheduler lost contact with this VM"
        " and more",
        "\u00e9\u00e9 binary \ufffd",
    ],
)
def test_a_fence_note_the_watchdog_never_writes_fails_the_job_counted(garbage: str) -> None:
    """An exit-0 attempt beside a fence note that is not the watchdog's: the job wrote it
    (same account). Not a lost node (uncounted, retried at once, for ever before the cap)
    and not a completion either (the scheduler cannot tell whether the attempt was cut
    short): the job's failure, counted."""
    assert not is_fence_note(garbage)
    verdict = job_verdict(RUNNING, parse_status(_probe(garbage))[(4, 1)])
    assert verdict is not None
    assert (verdict.to, verdict.failure_reason) == (
        JobStatus.FAILED,
        FailureReason.BAD_CONTROL_FILE,
    )
    assert "fenced_reason" in verdict.reason and garbage[:20] not in verdict.reason
    assert counts_against_limit(FailureReason.BAD_CONTROL_FILE.value)


@pytest.mark.parametrize("code", ["garbage", "9" * 30, "-1", "256", "0x0", "1 2"])
def test_a_garbage_exit_code_fails_the_job_counted(code: str) -> None:
    state = parse_status(_probe(None, code))[(4, 1)]
    verdict = job_verdict(RUNNING, state)
    assert verdict is not None
    assert (verdict.to, verdict.failure_reason) == (
        JobStatus.FAILED,
        FailureReason.BAD_CONTROL_FILE,
    )
    assert "exit_code" in verdict.reason


@dataclass
class _Job:
    retry_count: int
    max_retries: int
    attempt: int


@pytest.mark.parametrize(
    ("reason", "exit_code"),
    [("store_error", 74), ("node_lost", None), ("gpu_failed", None), ("launch_failed", 127)],
)
def test_uncounted_retries_are_capped_per_job_in_all(reason: str, exit_code: int | None) -> None:
    """20 uncounted retries in all (whatever their classes) by default; the 21st uncounted
    failure ends the job, saying how many of each class and the last one."""
    assert DEFAULT_POLICY.uncounted_limit == 20
    job = _Job(0, 3, 21)
    faults = 9 if reason != "store_error" else 0
    under = Failure(reason, exit_code, faults, {"store_error": 12, "node_lost": 7})
    assert isinstance(decide(job, under, NOW, random.Random(1)), Retry)
    failure = Failure(reason, exit_code, faults, {"store_error": 12, "node_lost": 8})
    decision = decide(job, failure, NOW, random.Random(1))
    assert isinstance(decision, GiveUp)
    assert decision.why.startswith(
        "gave up after 20 uncounted retries (store_error ×12, node_lost ×8): last: "
    ), decision.why
    assert failure.describe() in decision.why


def test_the_cap_reads_the_counts_of_a_row_without_trusting_them() -> None:
    """Counts from a row (possibly written by hand): negative, non-integer or huge values
    read as what they can mean, never raise."""
    policy = RetryPolicy(uncounted_limit=3)
    job = _Job(0, 0, 2)
    for counts in ({"node_lost": -5}, {"x": "y"}, {"store_error": True}, [], None, "garbage"):
        decision = decide(job, Failure("store_error", 74, 0, counts), NOW, random.Random(1), policy)
        assert isinstance(decision, Retry), counts
    huge = Failure("store_error", 74, 0, {"store_error": 2**70})
    assert isinstance(decide(job, huge, NOW, random.Random(1), policy), GiveUp)


def test_the_probe_reads_a_garbage_exit_code_as_the_jobs_failure(tmp_path: Path) -> None:
    """The real probe (sh) on an ended attempt whose `exit_code` a leftover of the job
    overwrote with garbage: `exited`, marked, and the job's failure, counted (it read as
    `unknown` before, and failed as `vanished`, "no pid file")."""
    run = Attempt(INSTALLATION, 4, 1, "0123456789abcdef")
    d = tmp_path / run.relative
    d.mkdir(parents=True)
    (d / "pid").write_text("999999\n")
    (d / "exit_code").write_text("garbage\n")
    out = subprocess.run(
        ["/bin/sh", "-c", status_probe([run])],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path)},
        check=True,
    ).stdout
    state = parse_status(out)[(4, 1)]
    assert (state.state, state.exit_code, state.bad_exit_code) == ("exited", None, True)
    verdict = job_verdict(RUNNING, state)
    assert verdict is not None and verdict.failure_reason == FailureReason.BAD_CONTROL_FILE
