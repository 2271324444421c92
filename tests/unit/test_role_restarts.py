"""Roles that heal in place, with real processes on this machine (the supervisor is a
plain program): a `restart` role that dies or stops answering is started again at the same
port while the primary role runs on; past its `max` the group fails as it always did; a
role without `restart` keeps shared fate, its liveness check included. And what the poll
reads of the restarts (`roles.json`, a file the job can write): bounded and validated."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler.poll import END, JOBS, parse_poll
from scheduler.remote.layout import Attempt
from scheduler.remote.probe import status_probe
from scheduler.remote.restarts import (
    ROLES_BYTES,
    ROLES_MARK,
    RoleRestarts,
    parse_restarts,
    recorded_restarts,
)
from scheduler.supervisor import NOT_READY_EXIT
from scheduler.verdicts import group_failure_line
from tests.unit.test_groups import alive, supervise, wait_for, write_group

# A primary role that waits for the test's go-ahead (the file `go`), then asks the server
# once at its address and port: exit 0 if it answered.
CLIENT = (
    "import os, sys, time, urllib.request\n"
    "folder = sys.argv[2]\n"
    "open(os.path.join(folder, 'client.pid'), 'w').write(str(os.getpid()))\n"
    "while not os.path.exists(os.path.join(folder, 'go')):\n"
    "    time.sleep(0.05)\n"
    "url = 'http://%s:%s/' % (os.environ['RLFLEET_SRV_ADDR'], os.environ['RLFLEET_SRV_HTTP'])\n"
    "urllib.request.urlopen(url, timeout=5).read()\n"
    "print('answered after the restart', flush=True)\n"
)


def healing_group(folder: Path, *, restarts: int | None, live_fail_s: float = 30) -> Path:
    """write_group's server and a client waiting for `go`; the server restarts in place at
    most `restarts` times (None: no `restart`, shared fate), its check made every 0.2 s."""
    path, _port = write_group(folder, server_delay=0, client_s=0)
    (folder / "client.py").write_text(CLIENT)
    config: dict[str, Any] = json.loads(path.read_text())
    srv = config["roles"][0]
    srv["live"] = True
    if restarts is not None:
        srv["restart"] = {"max": restarts}
    config |= {"restart_backoff_s": 0.2, "live_every_s": 0.2, "live_fail_s": live_fail_s}
    path.write_text(json.dumps(config))
    return path


def new_server_pid(folder: Path, old: int, timeout: float = 30) -> int:
    """The pid the restarted server wrote (another than `old`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (folder / "server.pid").read_text()
        if text and int(text) != old:
            return int(text)
        assert time.monotonic() < deadline, "the server was never started again"
        time.sleep(0.05)


def states(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "roles.json").read_text()))


@pytest.mark.slow
def test_a_killed_server_is_restarted_in_place_while_the_client_runs_on(tmp_path: Path) -> None:
    proc = supervise(healing_group(tmp_path, restarts=2))
    client = int(wait_for(tmp_path / "client.pid"))
    server = int(wait_for(tmp_path / "server.pid"))
    assert server > 1
    os.kill(server, signal.SIGKILL)
    again = new_server_pid(tmp_path, server)
    (tmp_path / "go").write_text("")
    out, _ = proc.communicate(timeout=60)
    # The client, never restarted, reached the new server at the same address and port.
    assert proc.returncode == 0, out
    assert "answered after the restart" in (tmp_path / "client.log").read_text()
    assert alive(client) is False and int((tmp_path / "client.pid").read_text()) == client
    restarting = "role srv failed (exit 137); restarting it in 0.2s (restart 1 of 2)"
    assert f"rlfleet-group: {restarting}" in out
    assert f"rlfleet-group: role srv restarted, pid {again} (restart 1 of 2)" in out
    assert group_failure_line(out) is None  # a restart is no reason the group ended
    srv = states(tmp_path)["srv"]
    assert srv["restarts"] == 1 and srv["restart_cause"] == "exited"
    assert srv["restart_exit"] == 137 and srv["pid"] == again and srv["state"] == "stopped"
    assert states(tmp_path)["client"]["restarts"] == 0
    assert not alive(again)


@pytest.mark.slow
def test_a_server_failing_past_its_max_restarts_fails_the_group(tmp_path: Path) -> None:
    proc = supervise(healing_group(tmp_path, restarts=1))
    client = int(wait_for(tmp_path / "client.pid"))
    server = int(wait_for(tmp_path / "server.pid"))
    os.kill(server, signal.SIGKILL)
    os.kill(new_server_pid(tmp_path, server), signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 137, out
    assert group_failure_line(out) == "role srv failed (exit 137) after 1 restart"
    assert not alive(client)
    assert states(tmp_path)["srv"]["restarts"] == 1


@pytest.mark.slow
def test_a_server_that_stops_answering_is_restarted_in_place(tmp_path: Path) -> None:
    proc = supervise(healing_group(tmp_path, restarts=1, live_fail_s=1))
    wait_for(tmp_path / "client.pid")
    server = int(wait_for(tmp_path / "server.pid"))
    try:
        os.kill(server, signal.SIGSTOP)  # alive, but answers nothing
        again = new_server_pid(tmp_path, server)
        assert not alive(server)  # the hung one was killed before the new one started
        (tmp_path / "go").write_text("")
        out, _ = proc.communicate(timeout=60)
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "rlfleet-group: role srv stopped answering its readiness check for 1s" in out
    srv = states(tmp_path)["srv"]
    assert srv["restarts"] == 1 and srv["restart_cause"] == "unresponsive"
    assert srv["restart_exit"] is None and srv["pid"] == again


@pytest.mark.slow
def test_without_restart_a_server_that_stops_answering_fails_the_group(tmp_path: Path) -> None:
    """Shared fate stays the default, and the readiness check goes on as a liveness check."""
    proc = supervise(healing_group(tmp_path, restarts=None, live_fail_s=1))
    client = int(wait_for(tmp_path / "client.pid"))
    server = int(wait_for(tmp_path / "server.pid"))
    try:
        os.kill(server, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=60)
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)
    assert proc.returncode == NOT_READY_EXIT, out
    assert group_failure_line(out) == "role srv stopped answering its readiness check for 1s"
    assert not alive(client) and "restart" not in out
    assert states(tmp_path)["srv"]["restarts"] == 0


@pytest.mark.slow
def test_without_restart_a_killed_server_still_fails_the_group(tmp_path: Path) -> None:
    proc = supervise(healing_group(tmp_path, restarts=None))
    wait_for(tmp_path / "client.pid")
    os.kill(int(wait_for(tmp_path / "server.pid")), signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 137, out
    assert group_failure_line(out) == "role srv failed (exit 137)"


# -- what the poll reads of them ------------------------------------------------------------


def test_the_poll_reads_each_roles_restarts_and_their_cause() -> None:
    roles = {
        "reward": {"pid": 9, "state": "running", "restarts": 2, "restart_cause": "exited",
                   "restart_exit": 137},
        "judge": {"state": "running", "restarts": 1, "restart_cause": "unresponsive",
                  "restart_exit": None},
        "trainer": {"pid": 8, "state": "running", "exit_code": None, "restarts": 0},
    }  # fmt: skip
    out = f"{JOBS}\n{ROLES_MARK} 7 2 {json.dumps(roles)}\n{END}\n"
    assert parse_poll(out).restarts == {
        (7, 2): {
            "reward": RoleRestarts(2, "exited", 137),
            "judge": RoleRestarts(1, "unresponsive", None),
        }
    }
    assert RoleRestarts(2, "exited", 137).why() == "it exited with 137"
    assert RoleRestarts(1, "unresponsive").why() == "it stopped answering its readiness check"
    # A cut-off answer (no end marker) tells nothing.
    assert parse_poll(f"{JOBS}\n{ROLES_MARK} 7 2 {json.dumps(roles)}\n").restarts == {}


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"reward": {"restarts": true}}',
        '{"reward": {"restarts": 101}}',
        '{"reward": {"restarts": -1}}',
        '{"reward": {"restarts": 1.5}}',
        '{"reward": {"restarts": "2"}}',
        '{"Reward; rm -rf": {"restarts": 1}}',
        '{"reward": 3}',
        '{"a": ' * 3000 + "1" + "}" * 3000,
        json.dumps({f"r{i}": {"restarts": 1} for i in range(17)}),
    ],
)
def test_a_roles_file_that_is_not_the_supervisors_counts_no_restart(text: str) -> None:
    assert parse_restarts(f"{ROLES_MARK} 7 2 {text}") == {}


def test_a_cause_that_is_not_the_supervisors_is_not_taken() -> None:
    text = '{"reward": {"restarts": 1, "restart_cause": "ran rm -rf", "restart_exit": 999}}'
    assert parse_restarts(f"{ROLES_MARK} 7 2 {text}") == {(7, 2): {"reward": RoleRestarts(1)}}
    text = '{"reward": {"restarts": 1, "restart_cause": "exited", "restart_exit": 999}}'
    assert parse_restarts(f"{ROLES_MARK} 7 2 {text}")[(7, 2)]["reward"].exit_code is None


def test_what_the_poller_recorded_counts_only_for_its_own_attempt() -> None:
    stored = {"attempt": 2, "roles": {"reward": 2, "bad": True, "worse": "x"}}
    assert recorded_restarts(stored, 2) == {"reward": 2}
    assert recorded_restarts(stored, 3) == {}
    assert recorded_restarts({}, 1) == recorded_restarts(None, 1) == {}


async def test_the_probe_reads_roles_json_bounded_and_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a real /bin/sh as on a VM: a roles.json over several lines arrives on one; a huge
    one is cut at ROLES_BYTES (and so is unreadable), never read whole."""
    from scheduler.transport import LocalTransport, VMTarget

    monkeypatch.setenv("HOME", str(tmp_path))
    runs = [
        Attempt("1b4e28ba-2fa1-41d2-883f-0016d3cca427", n, 1, "fedcba9876543210") for n in (7, 8)
    ]
    for run, text in zip(
        runs,
        [json.dumps({"reward": {"restarts": 1}}, indent=2), " " * 10_000_000 + "{}"],
        strict=True,
    ):
        folder = tmp_path / run.relative
        folder.mkdir(parents=True)
        (folder / "roles.json").write_text(text)
    local = VMTarget(id=1, name="local", host="localhost", transport="local")
    result = await LocalTransport().run(local, status_probe(runs), timeout=20)
    lines = [x for x in result.stdout.split("\n") if x.startswith(ROLES_MARK)]
    assert len(lines) == 2 and len(lines[1]) <= len(f"{ROLES_MARK} 8 1 ") + ROLES_BYTES
    assert parse_restarts(result.stdout) == {(7, 1): {"reward": RoleRestarts(1)}}


# -- what the launch and `job show` say of them ----------------------------------------------


def test_the_supervisor_is_told_which_roles_restart_and_which_it_checks_while_they_run() -> None:
    from scheduler.groups import LIVENESS_FAIL_S, RESTART_BACKOFF_S, GroupPlace, group_launch
    from scheduler.jobspec import parse_data

    group = parse_data(
        {
            "roles": {
                "reward": {
                    "command": ["srv"],
                    "ports": ["http"],
                    "ready": {"http": "/health"},
                    "restart": "on-failure",
                    "max_restarts": 5,
                },
                "judge": {"command": ["j"], "ports": ["http"], "ready": {"tcp": "http"}},
                "trainer": {"command": ["t"], "gpus": 1, "primary": True, "nodes": 2},
            }
        }
    )
    place = GroupPlace("python3", "train.py", "10.0.0.5", ["GPU-a"], "~/out", 1)
    ports = {("reward", "http"): 41000, ("judge", "http"): 41001, ("trainer", "@rendezvous"): 1}
    here = group_launch(group, place, ports, node=0, node_addresses=["10.0.0.5", "10.0.0.6"])
    roles = {r["name"]: r for r in here.config["roles"]}
    assert roles["reward"]["restart"] == {"max": 5} and roles["reward"]["live"]
    assert "restart" not in roles["judge"] and roles["judge"]["live"]
    assert "restart" not in roles["trainer"] and not roles["trainer"]["live"]
    assert here.config["restart_backoff_s"] == RESTART_BACKOFF_S
    assert here.config["live_fail_s"] == LIVENESS_FAIL_S
    # Rank 1 of the trainer's VM runs no role with a check of its own.
    there = group_launch(group, place, ports, node=1, node_addresses=["10.0.0.5", "10.0.0.6"])
    assert [(r["name"], r["live"]) for r in there.config["roles"]] == [("trainer", False)]


def test_job_show_takes_the_vms_restart_count_only_when_it_is_the_supervisors() -> None:
    from scheduler.control import merge_role_states

    def shown(entry: object, recorded: int = 1) -> int:
        roles: list[dict[str, Any]] = [{"name": "reward", "node": 0, "restarts": recorded}]
        merge_role_states(roles, {"reward": entry})
        return int(roles[0]["restarts"])

    assert shown({"state": "restarting", "restarts": 2}) == 2
    assert shown({"state": "running", "restarts": 0}) == 1  # the poller had seen more
    for bad in (True, 101, -3, "9", 2.0):
        assert shown({"state": "running", "restarts": bad}) == 1
    assert shown({"state": "asleep", "restarts": 2}) == 1  # not a state the supervisor writes
