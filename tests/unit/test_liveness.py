"""The liveness knobs, the attempt's lease and its watchdog (run in a real /bin/sh)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.liveness import Liveness, SSHDeadlines
from scheduler.remote.layout import Attempt
from scheduler.remote.probe import RemoteJobState, parse_status, status_probe
from scheduler.remote.watchdog import (
    FENCED_FILE,
    LEASE_FILE,
    fence_note,
    is_fence_note,
    lease_touch_lines,
    watchdog_lines,
    watchdog_stop_lines,
)
from scheduler.states import FailureReason, JobStatus
from scheduler.verdicts import LiveJob, job_verdict

INSTALLATION = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
TOKEN = "0123456789abcdef"


def test_the_defaults_are_consistent_and_unsafe_values_are_named() -> None:
    assert Liveness().problems() == []
    assert Liveness(fence_after_s=0).problems() == []  # no watchdogs: nothing to check
    early = Liveness(node_lost_timeout_s=20).problems()
    assert len(early) == 1 and "node-lost timeout" in early[0]
    slow = Liveness(poll_timeout_s=15).problems()
    assert len(slow) == 1 and "fence after" in slow[0]
    flappy = Liveness(unreachable_timeout_s=4).problems()
    assert len(flappy) == 1 and "unreachable timeout" in flappy[0]


def test_flags_win_over_the_environment_which_wins_over_defaults() -> None:
    env = {"RLFLEET_NODE_LOST_TIMEOUT": "40", "RLFLEET_FENCE_AFTER": "20"}
    knobs = Liveness.from_env({"fence_after_s": 25.0, "poll_timeout_s": None}, env)
    assert (knobs.node_lost_timeout_s, knobs.fence_after_s) == (40.0, 25.0)
    assert knobs.poll_timeout_s == Liveness().poll_timeout_s
    with pytest.raises(ValueError, match="RLFLEET_FENCE_GRACE"):
        Liveness.from_env(env={"RLFLEET_FENCE_GRACE": "soon"})
    ssh = SSHDeadlines.from_env({"RLFLEET_SSH_KEEPALIVE_INTERVAL": "1"})
    assert (ssh.keepalive_interval_s, ssh.dead_after_s) == (1.0, 4.0)


@pytest.mark.slow
def test_a_daemon_refuses_unsafe_settings_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler.requeue", "--node-lost-timeout", "10"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "node-lost timeout (10s) must be at least" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_probe_renews_leases_and_reports_fenced_attempts(tmp_path: Path) -> None:
    # Given one attempt fenced and one missing (its directory must not be created)
    fenced, missing = Attempt(INSTALLATION, 7, 1, TOKEN), Attempt(INSTALLATION, 8, 1, TOKEN)
    attempt = tmp_path / fenced.relative
    attempt.mkdir(parents=True)
    (attempt / "pid").write_text("999999\n")
    (attempt / "exit_code").write_text("143\n")
    (attempt / FENCED_FILE).write_text(fence_note(18, 18) + "\n")  # the watchdog's line
    out = subprocess.run(
        ["/bin/sh", "-c", status_probe([fenced, missing])],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path)},
        check=True,
    ).stdout
    # Then the lease is renewed, the fence reported, and nothing made for the missing one
    assert (attempt / LEASE_FILE).exists()
    assert not (tmp_path / missing.relative).exists()
    states = parse_status(out)
    assert states[(7, 1)].fenced == fence_note(18, 18)
    assert states[(8, 1)] == RemoteJobState("unknown")
    verdict = job_verdict(LiveJob(7, 1, "running", 1, 999999), states[(7, 1)])
    assert verdict is not None and verdict.to == JobStatus.FAILED
    assert verdict.failure_reason == FailureReason.NODE_LOST
    assert verdict.reason.startswith("node_lost (fenced): attempt 1 stopped by its watchdog")


def _attempt(
    tmp_path: Path, training: str, fence_after: float, grace: float
) -> subprocess.Popen[bytes]:
    """Start a wrapper-like script: a watchdog beside `training`, as launch.sh runs it."""
    d = tmp_path / "attempt"
    d.mkdir()
    script = "\n".join(
        [
            f"d={d}",
            "trap 'rlfleet_sig=TERM' TERM",
            *watchdog_lines(fence_after, grace),
            training,
            "rc=$?",
            *watchdog_stop_lines(),
            'echo "$rc" > "$d/exit_code"',
            "",
        ]
    )
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script],
        stdout=(d / "train.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Whether any process of the attempt runs (its leader reaped first: a zombie counts)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(condition: object, timeout: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.slow
def test_a_lease_not_renewed_fences_the_attempt_term_then_kill(tmp_path: Path) -> None:
    # Given training that ignores TERM, and nobody renewing its lease
    proc = _attempt(tmp_path, "sh -c 'trap \"\" TERM; sleep 60'", fence_after=2, grace=1)
    d = tmp_path / "attempt"
    try:
        # Then the watchdog fences it after ~2 s: reason, log line, TERM, KILL after 1 s
        took = _wait(lambda: not _group_alive(proc), 15)
        assert 2 <= took < 2 + 2 + 1 + 2
        assert "lease not renewed" in (d / FENCED_FILE).read_text()
        # The line the real watchdog writes is the one the poller takes for a fence.
        assert is_fence_note((d / FENCED_FILE).read_text().strip())
        log = (d / "train.log").read_text()
        assert "rlfleet: fenced:" in log and "KILL" in log
        assert (d / "exit_code").read_text().strip() == "137"
    finally:
        with_group_killed(proc)


@pytest.mark.slow
def test_a_renewed_lease_keeps_the_attempt_and_the_watchdog_ends_with_it(tmp_path: Path) -> None:
    # Given training of 4 s whose lease is renewed every 0.5 s, with a 2 s fence
    proc = _attempt(tmp_path, "sleep 4", fence_after=2, grace=1)
    d = tmp_path / "attempt"
    try:
        started = time.monotonic()
        while not (d / "exit_code").exists():
            assert time.monotonic() - started < 15
            (d / LEASE_FILE).touch()
            time.sleep(0.5)
        # Then it ran to its end, unfenced, and nothing of it (the watchdog) is left
        assert (d / "exit_code").read_text().strip() == "0"
        assert not (d / FENCED_FILE).exists()
        # (and the watchdog wrote nothing: no shell job message may pass for a death by
        # signal in the log the poller classifies failures by)
        assert (d / "train.log").read_text() == ""
        assert _wait(lambda: not _group_alive(proc), 2) < 1.5
    finally:
        with_group_killed(proc)


def test_lease_touch_needs_the_attempt_directory() -> None:
    assert lease_touch_lines() == ['if [ -d "$d" ]; then : 2>/dev/null <>"$d/lease"; fi']
    assert watchdog_lines(0, 5) == ["rlfleet_wd="]


def with_group_killed(proc: subprocess.Popen[bytes]) -> None:
    """Kill what is left of the attempt (a failed test must leave nothing behind)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
