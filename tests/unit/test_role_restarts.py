"""Roles that heal in place, with real processes on this machine (the supervisor is a
plain program): a `restart` role that dies or stops answering is started again at the same
port while the primary role runs on; past its `max` the group fails as it always did; a
role without `restart` keeps shared fate, its liveness check included."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from scheduler.supervisor import NOT_READY_EXIT
from scheduler.verdicts import group_failure_line
from tests.unit.test_groups import alive, supervise, wait_for, write_group

pytestmark = pytest.mark.slow

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
    assert "rlfleet-group: role srv exit 137; restarting it in 0.2s (restart 1 of 2)" in out
    assert f"rlfleet-group: role srv restarted, pid {again} (restart 1 of 2)" in out
    srv = states(tmp_path)["srv"]
    assert srv["restarts"] == 1 and srv["restart_cause"] == "exited"
    assert srv["restart_exit"] == 137 and srv["pid"] == again and srv["state"] == "stopped"
    assert states(tmp_path)["client"]["restarts"] == 0
    assert not alive(again)


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


def test_without_restart_a_killed_server_still_fails_the_group(tmp_path: Path) -> None:
    proc = supervise(healing_group(tmp_path, restarts=None))
    wait_for(tmp_path / "client.pid")
    os.kill(int(wait_for(tmp_path / "server.pid")), signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 137, out
    assert group_failure_line(out) == "role srv failed (exit 137)"

