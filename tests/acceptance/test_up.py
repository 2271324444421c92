"""`rlfleet up`: one machine runs everything, a job runs on it as on any VM, Ctrl-C/SIGTERM
stops it all, and a second start reuses the data on the same ports."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.embedded import EmbeddedPostgres, free_port
from scheduler.statedir import port_is_free
from scheduler.up import read_env_file, write_sim_nvidia_smi
from tests.workloads.support import FAKE_TRAIN, RLFLEET, alive

REPO = Path(__file__).resolve().parents[2]


class Up:
    """One `rlfleet up` subprocess in its own process group."""

    def __init__(
        self, state_dir: Path, home: Path, *args: str, open_files: int | None = None
    ) -> None:
        """`open_files`: start it under that open-files limit (soft and hard)."""
        self.state_dir = state_dir
        self.env = {**os.environ, "HOME": str(home), "RLFLEET_LOG_LEVEL": "INFO"}
        for var in (
            "RLFLEET_DATABASE_URL", "RLFLEET_NATS_URL", "RLFLEET_NATS_TOKEN",
            "CUDA_VISIBLE_DEVICES",
        ):  # fmt: skip
            self.env.pop(var, None)
        self.log = state_dir.parent / f"up-{time.monotonic_ns()}.log"
        with self.log.open("wb") as handle:
            self.proc = subprocess.Popen(
                [str(RLFLEET), "up", "--state-dir", str(state_dir), *args],
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if open_files is None else _limit_open_files(open_files),
            )

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> dict:
        """up.json once this process says it is ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"up exited {self.proc.returncode}:\n{self.output()}"
            try:
                state = json.loads((self.state_dir / "up.json").read_text())
            except (OSError, ValueError):
                state = {}
            if state.get("ready") and state.get("pid") == self.proc.pid:
                return state
            time.sleep(0.2)
        raise AssertionError(f"up not ready after {timeout}s:\n{self.output()}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`rlfleet ARGS` pointed at this up's services by its env file, as `source` would."""
        env = {**self.env, **read_env_file(self.state_dir / "env")}
        return subprocess.run(
            [str(RLFLEET), *args], env=env, capture_output=True, text=True, timeout=60
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal it like systemd or Ctrl-C would, and wait for it to finish."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                raise
        return self.proc.returncode


def _limit_open_files(n: int):  # type: ignore[no-untyped-def]
    """A `preexec_fn` setting the open-files limit to `n` (soft and hard), as `ulimit -n`."""

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


@pytest.fixture
def ups(tmp_path: Path) -> Iterator[list[Up]]:
    """Every `up` a test starts; each is stopped (or killed) afterwards."""
    started: list[Up] = []
    yield started
    for up in started:
        if up.proc.poll() is None:
            try:
                with_servers = json.loads((up.state_dir / "up.json").read_text())
            except (OSError, ValueError):
                with_servers = {}
            os.killpg(up.proc.pid, signal.SIGKILL)
            up.proc.wait(10)
            for pid in (with_servers.get("server_pids") or {}).values():
                if pid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)


def wait_for(fn, timeout: float, what: str):  # type: ignore[no-untyped-def]
    """Poll `fn()` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_up_runs_a_job_on_the_local_vm_stops_cleanly_and_restarts_on_the_same_data(
    tmp_path: Path, ups: list[Up]
) -> None:
    state_dir, home = tmp_path / "state", tmp_path / "home"
    home.mkdir()
    # Given `rlfleet up --local-vm --gpus 2` on a machine without nvidia-smi
    metrics_port = free_port()
    up = Up(
        state_dir, home, "--local-vm", "--gpus", "2", "--entrypoint", str(FAKE_TRAIN),
        "--metrics-port", str(metrics_port),
    )  # fmt: skip
    ups.append(up)
    state = up.wait_ready()
    # Then it prints how to reach its services, and none of their secrets
    assert f"source {state_dir / 'env'}" in up.output()
    for secret in ("postgres.password", "nats.token"):
        assert (state_dir / secret).read_text().strip() not in up.output()
    # And the poller finds the machine's two (simulated) GPUs
    vm = wait_for(
        lambda: (
            (v := json.loads(up.cli("vm", "show", "local", "--json").stdout or "{}"))
            and v.get("status") == "healthy"
            and len(v.get("gpus", [])) == 2
            and v
        ),
        60,
        "the local VM to be healthy with 2 GPUs",
    )
    assert vm["transport"] == "local"

    # When a job is submitted, it runs there (on one of the GPUs) and completes
    submitted = up.cli(
        "job", "submit", "--model", "m", "--dataset", "d.jsonl", "--reward-function", "r",
        "--", "--fake_seconds", "1",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    job = wait_for(
        lambda: (
            (j := json.loads(up.cli("job", "show", job_id, "--json").stdout or "{}"))
            and j.get("status") in ("completed", "failed", "cancelled")
            and j
        ),
        90,
        f"job {job_id} to finish",
    )
    assert job["status"] == "completed", job
    assert [e["to"] for e in job["events"]][-2:] == ["running", "completed"]
    assert job["attempt_dir"].startswith(f"{home}/.rlfleet/")
    assert (Path(job["attempt_dir"]) / "exit_code").read_text().strip() == "0"
    # And its metrics saw the dispatch, the job's wait and its start
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        page = r.read().decode()
    for name in (
        "rlfleet_dispatch_duration_seconds_count",
        "rlfleet_job_queue_wait_seconds_count",
        "rlfleet_job_submit_to_running_seconds_count",
        "rlfleet_poll_sweep_duration_seconds_count",
    ):
        assert re.search(rf"^{name} [1-9]", page, re.MULTILINE), name

    # When it is stopped with SIGTERM
    servers = json.loads((state_dir / "up.json").read_text())["server_pids"]
    assert up.stop(signal.SIGTERM) == 0, up.output()[-3000:]
    # Then its Postgres and NATS are gone too
    assert not any(alive(pid) for pid in servers.values()), servers

    # When it starts again on the same state directory (Ctrl-C this time)
    again = Up(state_dir, home, "--local-vm", "--gpus", "2", "--entrypoint", str(FAKE_TRAIN))
    ups.append(again)
    restarted = again.wait_ready()
    # Then the ports were remembered and the job is still there
    assert restarted["database_url"] == state["database_url"]
    assert restarted["nats_url"] == state["nats_url"]
    listed = json.loads(again.cli("job", "list", "--json").stdout)
    assert [(str(j["id"]), j["status"]) for j in listed] == [(job_id, "completed")]
    assert again.stop(signal.SIGINT) == 0, again.output()[-3000:]


@pytest.mark.slow
def test_a_second_up_on_the_same_state_dir_is_refused(tmp_path: Path, ups: list[Up]) -> None:
    state_dir = tmp_path / "state"
    first = Up(state_dir, tmp_path)
    ups.append(first)
    first.wait_ready()
    second = Up(state_dir, tmp_path)
    ups.append(second)
    assert second.proc.wait(60) == 1
    lines = second.output().strip().splitlines()
    assert lines[-1].startswith("Error: another `rlfleet up`"), lines
    assert first.proc.poll() is None
    assert first.stop() == 0


@pytest.mark.slow
def test_local_vm_without_nvidia_smi_needs_gpus(tmp_path: Path) -> None:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    if shutil.which("nvidia-smi", path=path):
        pytest.skip("this machine has a real nvidia-smi")
    env = {**os.environ, "PATH": path}
    result = subprocess.run(
        [str(RLFLEET), "up", "--state-dir", str(tmp_path / "s"), "--local-vm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: no nvidia-smi on this machine: pass --gpus N to simulate N GPUs"
    )


def test_simulated_nvidia_smi_shows_the_gpu_a_live_process_holds(tmp_path: Path) -> None:
    # Given the simulated nvidia-smi of a local VM with two GPUs
    smi = write_sim_nvidia_smi(tmp_path, gpus=2, vm="box")
    query = ["--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]
    apps = ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
    idle = subprocess.run([str(smi), *query], capture_output=True, text=True, check=True)
    assert idle.stdout.splitlines() == ["0, 0, 0", "1, 0, 0"]
    # When a process of that VM holds GPU 1 (and one of another VM holds GPU 0)
    env = {**os.environ, "RLFLEET_SIM_VM": "box", "CUDA_VISIBLE_DEVICES": "1"}
    other = {**os.environ, "RLFLEET_SIM_VM": "elsewhere", "CUDA_VISIBLE_DEVICES": "0"}
    holder = subprocess.Popen(["sleep", "30"], env=env)
    stranger = subprocess.Popen(["sleep", "30"], env=other)
    try:
        busy = subprocess.run([str(smi), *query], capture_output=True, text=True, check=True)
        held = subprocess.run([str(smi), *apps], capture_output=True, text=True, check=True)
    finally:
        holder.kill()
        stranger.kill()
        holder.wait()
        stranger.wait()
    # Then only GPU 1 shows as used, by that process
    assert busy.stdout.splitlines() == ["0, 0, 0", "1, 1024, 100"]
    assert [line.split(", ")[1] for line in held.stdout.splitlines()] == [str(holder.pid)]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (e.g. a directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and alive(int(entry.name)):
            found.append(cmdline)
    return found


@pytest.mark.slow
def test_demo_trains_through_the_scheduler_and_leaves_nothing_running(tmp_path: Path) -> None:
    # Given the demo, shortened to two GRPO steps
    demo_dir = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RLFLEET_DATABASE_URL", "RLFLEET_NATS_URL"):
        env.pop(var, None)
    # When it runs
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--max-steps", "2",
         "--dir", str(demo_dir), "--timeout", "400"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = result.stdout
    # Then the job went through its states and completed, and the demo says where the
    # model is and what the reward was at both ends
    assert result.returncode == 0, out[-3000:] + result.stderr[-2000:]
    for move in ("queued -> starting", "starting -> running", "running -> completed"):
        assert move in out, out
    model = re.search(r"trained model: (\S+)", out)
    assert model and (Path(model.group(1)) / "config.json").exists(), out
    assert re.search(r"mean reward \(keyword 'hello'\): start \d\.\d{3} -> end \d\.\d{3}", out)
    # And nothing it started is still running
    assert processes_mentioning(str(demo_dir)) == []


NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# What another local user can do without any credential, with the standard library only:
# ask Postgres to let `postgres` in, and send NATS a CONNECT with no credentials.
_INTRUDER = r"""
import socket, struct, sys
pg_port, nats_port = int(sys.argv[1]), int(sys.argv[2])
with socket.create_connection(("127.0.0.1", pg_port), timeout=10) as s:
    params = b"user\0postgres\0database\0postgres\0\0"
    s.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
    kind, _length, code = struct.unpack("!cii", s.recv(9))
    print("pg", "trusted" if (kind, code) == (b"R", 0) else f"asks:{kind.decode()}{code}")
with socket.create_connection(("127.0.0.1", nats_port), timeout=10) as s:
    f = s.makefile("rb")
    f.readline()  # INFO
    s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
    print("nats", f.readline().decode().strip())
"""


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run `argv` as the unprivileged user `nobody` (the tests run as root)."""
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60, cwd="/")


@pytest.mark.slow
def test_other_local_users_are_refused_by_both_services_also_on_an_older_state_dir(
    tmp_path: Path, ups: list[Up]
) -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as another user")
    state_dir, home = tmp_path / "state", tmp_path / "home"
    home.mkdir()
    # Given a state directory an older rlfleet made: Postgres trusting every local client
    EmbeddedPostgres(state_dir / "postgres").start().stop()
    # When `rlfleet up` runs on it
    up = Up(state_dir, home)
    ups.append(up)
    state = up.wait_ready()
    ports = json.loads((state_dir / "up.json").read_text())["ports"]
    # Then another local user is refused by Postgres (a password is asked) and by NATS
    seen = as_nobody(
        "/usr/bin/python3", "-c", _INTRUDER, str(ports["postgres"]), str(ports["nats"])
    )
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.splitlines() == ["pg asks:R10", "nats -ERR 'Authorization Violation'"]
    # And cannot read the credentials, nor anything else in the state directory
    assert oct((state_dir).stat().st_mode & 0o777) in ("0o700", "0o710")
    for name in ("env", "postgres.password", "nats.token", "up.json"):
        assert (state_dir / name).stat().st_mode & 0o777 == 0o600, name
        assert as_nobody("cat", str(state_dir / name)).returncode != 0, name
    assert as_nobody("ls", str(state_dir)).returncode != 0
    # And the state file names no secret
    from sqlalchemy.engine import make_url

    assert make_url(state["database_url"]).password is None
    # While the owner's CLI works with the env file
    listed = up.cli("vm", "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    submitted = up.cli("job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "r")
    assert submitted.returncode == 0, submitted.stderr
    # And without the credentials the owner's CLI is refused too, in one line
    bare = subprocess.run(
        [str(RLFLEET), "--database-url", state["database_url"], "job", "list"],
        env=up.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bare.returncode == 1 and len(bare.stderr.strip().splitlines()) == 1, bare.stderr
    assert up.stop() == 0, up.output()[-3000:]


@pytest.mark.slow
def test_up_serves_the_dashboard_with_a_token_it_keeps_to_itself(
    tmp_path: Path, ups: list[Up]
) -> None:
    # Given `rlfleet up --web-port P`
    state_dir, port = tmp_path / "state", free_port()
    up = Up(state_dir, tmp_path, "--web-port", str(port))
    ups.append(up)
    up.wait_ready()
    # Then the dashboard answers reads on loopback, with the job a user submits
    submitted = up.cli("job", "submit", "--model", "m", "--dataset", "d",
                       "--reward-function", "format", "--name", "seen-on-the-web")  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr

    def queue() -> str:
        url = f"http://127.0.0.1:{port}/api/jobs"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 (loopback)
                return str(answer.read().decode())
        except OSError:
            return ""

    assert "seen-on-the-web" in wait_for(queue, 60, "the dashboard's job list")
    # And an action needs the token, which lives 0600 in the state dir and is never printed
    token_file = state_dir / "web.token"
    token = token_file.read_text().strip()
    assert token and token_file.stat().st_mode & 0o077 == 0
    job_id = submitted.stdout.strip().split()[-1]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/jobs/{job_id}/cancel", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)  # noqa: S310 (loopback)
    assert refused.value.code == 401
    request.add_header("X-Rlfleet-Token", token)
    with urllib.request.urlopen(request, timeout=5) as answer:  # noqa: S310 (loopback)
        assert answer.status == 200
    assert up.cli("job", "show", job_id, "--json", "--no-progress").stdout.count('"cancelled"')
    assert str(token_file) in up.output() and token not in up.output()
    assert up.stop() == 0


SLOW_LORIS = r"""
import resource, socket, sys, time
# The flooder's own limit, not the server's: enough descriptors for every connection.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
targets = [(int(port), int(count)) for port, count in (a.split(":") for a in sys.argv[1:])]
open_ = {port: [] for port, _ in targets}
opened = 0
while True:
    for port, count in targets:
        alive = []
        for sock in open_[port]:
            try:
                sock.send(b"X-a: b\r\n")  # a header line now and then, never the end
                alive.append(sock)
            except OSError:
                sock.close()
        while len(alive) < count:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=2)
                sock.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                alive.append(sock)
                opened += 1
            except OSError:
                break
        open_[port] = alive
    print(opened, {p: len(s) for p, s in open_.items()}, flush=True)
    time.sleep(1)
"""


@pytest.mark.slow
def test_a_slow_loris_flood_on_the_dashboard_and_metrics_costs_the_flooder_not_the_jobs(
    tmp_path: Path, ups: list[Up]
) -> None:
    state_dir, home = tmp_path / "state", tmp_path / "home"
    home.mkdir()
    web_port, metrics_port = free_port(), free_port()
    # Given `rlfleet up --web-port --metrics-port` with a local VM, under the common limit
    # of 1,024 open files (soft and hard: it cannot raise it)
    up = Up(
        state_dir, home, "--local-vm", "--gpus", "1", "--entrypoint", str(FAKE_TRAIN),
        "--web-port", str(web_port), "--metrics-port", str(metrics_port), open_files=1024,
    )  # fmt: skip
    ups.append(up)
    up.wait_ready()
    wait_for(
        lambda: (
            json.loads(up.cli("vm", "show", "local", "--json").stdout or "{}").get("status")
            == "healthy"
        ),
        60,
        "the local VM to be healthy",
    )
    # When a local user without any token keeps 1,100 half-sent requests open on the
    # dashboard and 300 on the metrics endpoint, reopening what the server closes
    flood_log = tmp_path / "flood.log"
    with flood_log.open("wb") as out:
        flood = subprocess.Popen(
            [sys.executable, "-c", SLOW_LORIS, f"{web_port}:1100", f"{metrics_port}:300"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: len(flood_log.read_text().splitlines()) >= 5, 60, "the flood")
        # And a job that trains for 40 s (longer than a VM may stay unanswered) is
        # submitted and runs through it
        submitted = up.cli(
            "job", "submit", "--model", "m", "--dataset", "d.jsonl", "--reward-function",
            "r", "--", "--fake_seconds", "40",
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        job = wait_for(
            lambda: (
                (j := json.loads(up.cli("job", "show", job_id, "--json").stdout or "{}"))
                and j.get("status") in ("completed", "failed", "cancelled")
                and j
            ),
            150,
            f"job {job_id} to finish",
        )
        vm = json.loads(up.cli("vm", "show", "local", "--json").stdout)
        still_flooding = flood.poll() is None
    finally:
        flood.kill()
        flood.wait(10)
    # Then the job completed on its first attempt, never taken for lost, the VM healthy
    assert still_flooding, flood_log.read_text()[-2000:]
    assert job["status"] == "completed", job
    assert job["retry_count"] == 0 and job["attempt"] == 1, job
    assert not [e for e in job["events"] if "node_lost" in (e["reason"] or "")], job["events"]
    assert vm["status"] == "healthy", vm
    # And the flood was really held off: the servers closed the connections they had no
    # room or no patience for, so the flooder had to open many more than it keeps
    opened = int(flood_log.read_text().splitlines()[-1].split()[0])
    print(f"\nflood: {opened} connections opened; up's log {len(up.output())} bytes")
    assert opened > 1400, flood_log.read_text()[-2000:]
    # And `up`'s log stayed small (no traceback per refused connection)
    assert len(up.output()) < 2_000_000, len(up.output())

    # And once the flood stops, both servers answer again
    def answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 (loopback)
                return answer.status == 200
        except OSError:
            return False

    wait_for(lambda: answers(f"http://127.0.0.1:{web_port}/api/jobs"), 60, "the dashboard")
    wait_for(lambda: answers(f"http://127.0.0.1:{metrics_port}/metrics"), 60, "the metrics")
    assert up.stop() == 0, up.output()[-3000:]


def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


@pytest.mark.slow
def test_the_dashboard_process_ends_with_up_even_when_up_is_killed(
    tmp_path: Path, ups: list[Up]
) -> None:
    # Given `rlfleet up --web-port`, whose dashboard runs in a child process
    state_dir, port = tmp_path / "state", free_port()
    up = Up(state_dir, tmp_path, "--web-port", str(port))
    ups.append(up)
    up.wait_ready()
    web = web_children(up)
    assert len(web) == 1, children(up.proc.pid)
    servers = json.loads((state_dir / "up.json").read_text())["server_pids"]
    try:
        # When `up` is killed outright (no chance to stop anything)
        up.proc.kill()
        up.proc.wait(10)
        # Then the dashboard's process ends too, and nothing listens on its port
        wait_for(lambda: not alive(web[0]), 20, "the dashboard process to end")
        assert port_is_free(port)
    finally:
        for pid in servers.values():  # what a killed `up` leaves for the next one to stop
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.kill(pid, signal.SIGKILL)


def web_children(up: Up) -> list[int]:
    """The pids of the dashboard's process of `up` (`rlfleet web` started by it)."""
    found = []
    for pid in children(up.proc.pid):
        with contextlib.suppress(OSError):
            if b"web" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
    return found


@pytest.mark.slow
def test_a_dashboard_process_that_dies_is_started_again(tmp_path: Path, ups: list[Up]) -> None:
    # Given `rlfleet up --web-port` serving its dashboard
    state_dir, port = tmp_path / "state", free_port()
    up = Up(state_dir, tmp_path, "--web-port", str(port))
    ups.append(up)
    up.wait_ready()
    [first] = web_children(up)
    # When the dashboard's process is killed
    os.kill(first, signal.SIGKILL)

    def answers() -> bool:
        try:
            url = f"http://127.0.0.1:{port}/api/jobs"
            with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 (loopback)
                return answer.status == 200
        except OSError:
            return False

    # Then `up` goes on and starts another, which serves the dashboard again
    wait_for(lambda: web_children(up) not in ([], [first]) and answers(), 30, "a new dashboard")
    assert up.proc.poll() is None
    assert up.stop() == 0, up.output()[-3000:]
