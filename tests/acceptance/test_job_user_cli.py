"""`rlfleet vm add/set --job-user` (scheduler/remote/jobuser.py): a validated POSIX user
name, stored in `vms.job_user` and shown by `vm show`/`vm list --json`; bad input is exit 2
and one line. The real CLI as a subprocess, against real Postgres and NATS."""

from __future__ import annotations

import json

import pytest

from tests.acceptance.test_cli import snapshot
from tests.acceptance.test_cli_input import assert_one_line, env, rlfleet

__all__ = ["env"]  # the fixture, imported for this module's tests

pytestmark = pytest.mark.slow


def _show(env: dict[str, str], name: str) -> dict[str, object]:
    result = rlfleet(env, "vm", "show", name, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_job_user_is_set_shown_changed_and_cleared(env: dict[str, str]) -> None:
    # Given a VM added with a job user
    added = rlfleet(env, "vm", "add", "g1", "--host", "10.0.0.9", "--job-user", "rljob")
    assert added.returncode == 0 and added.stderr == "", added.stderr
    # Then vm show and vm list --json say so
    assert _show(env, "g1")["job_user"] == "rljob"
    listed = json.loads(rlfleet(env, "vm", "list", "--json").stdout)
    assert [vm["job_user"] for vm in listed] == ["rljob"]
    # When vm set changes it, then clears it
    changed = rlfleet(env, "vm", "set", "g1", "--job-user", "other_1")
    assert changed.returncode == 0 and changed.stderr == "", changed.stderr
    assert _show(env, "g1")["job_user"] == "other_1"
    assert rlfleet(env, "vm", "set", "g1", "--no-job-user").returncode == 0
    assert _show(env, "g1")["job_user"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["vm", "add", "g2", "--host", "h", "--job-user", "Bad User"], "invalid job user"),
        (["vm", "add", "g2", "--host", "h", "--job-user", "x;rm -rf ~"], "invalid job user"),
        (["vm", "add", "g2", "--host", "h", "--job-user", "-n"], "invalid job user"),
        (["vm", "add", "g2", "--host", "h", "--job-user", "a" * 33], "invalid job user"),
        (["vm", "add", "g2", "--host", "h", "--job-user", "root"], "cannot be root"),
        (["vm", "set", "g0", "--job-user", "J"], "invalid job user"),
        (["vm", "set", "g0", "--job-user", "j", "--no-job-user"], "not both"),
        (["vm", "set", "g0"], "nothing to change"),
        (["vm", "set", "ghost", "--job-user", "j"], "no VM named 'ghost'"),
    ],
)
def test_a_bad_job_user_is_exit_2_one_line_and_changes_nothing(
    env: dict[str, str], args: list[str], message: str
) -> None:
    assert rlfleet(env, "vm", "add", "g0", "--host", "10.0.0.9").returncode == 0
    before = snapshot(env["RLFLEET_DATABASE_URL"])
    assert_one_line(rlfleet(env, *args), 2, message)
    assert snapshot(env["RLFLEET_DATABASE_URL"]) == before
