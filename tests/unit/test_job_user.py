"""The job user's name and what a bad one read from a VM row does
(scheduler/remote/jobuser.py): the VM's launches and kills fail with a reason, no daemon
raises, and nothing of it reaches shell text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scheduler.kill import kill_attempt
from scheduler.remote.jobuser import checked_job_user, job_user_problem, ready_check
from scheduler.remote.layout import Attempt
from scheduler.transport import SSHTransport, VMTarget


@pytest.mark.parametrize("name", ["rljob", "_svc", "job-user_2", "a" * 32])
def test_posix_user_names_are_accepted(name: str) -> None:
    assert job_user_problem(name) is None


@pytest.mark.parametrize(
    "name", ["", "Root", "root", "-n", "1job", "a b", "a;b", "$(id)", "a" * 33, "é", "a\n"]
)
def test_anything_else_is_refused(name: str) -> None:
    assert job_user_problem(name) is not None


def _target(job_user: str | None) -> VMTarget:
    return VMTarget(id=1, name="v", host="127.0.0.1", port=1, job_user=job_user)


async def test_a_bad_row_fails_the_vms_kills_and_checks_without_running_anything(
    tmp_path: Path,
) -> None:
    # Given a VM row whose job_user no valid input could have stored
    pwned = tmp_path / "pwned"
    target = _target(f"x; touch {pwned}")
    problem = checked_job_user(target)
    assert not isinstance(problem, str) and problem is not None
    # Then a kill reports why, without connecting (port 1 would refuse) and without raising
    run = Attempt("00000000-0000-4000-8000-000000000001", 1, 1, "0123456789abcdef")
    transport = SSHTransport()
    try:
        result = await kill_attempt(transport, target, run, grace_s=1)
    finally:
        await transport.close()
    assert result.outcome is None and "invalid job user" in (result.error or "")
    # And the poll's readiness check fails (exit 127, saying why), running nothing of it
    check = ready_check(target, "true")
    done = subprocess.run(["sh", "-c", check], capture_output=True, text=True, timeout=10)
    assert done.returncode == 127 and "invalid job user" in done.stdout
    assert not pwned.exists()


def test_without_a_job_user_the_check_is_unchanged() -> None:
    assert ready_check(_target(None), "python3 -c pass") == "python3 -c pass"


def test_the_supervisors_name_is_the_launchs() -> None:
    from scheduler.remote import jobuser
    from scheduler.remote.launch import SUPERVISOR_FILE

    assert jobuser.SUPERVISOR == SUPERVISOR_FILE
