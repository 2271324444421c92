"""What a job writes into its attempt directory, or puts in its environment, costs only that
job (docs/invariants.md, invariant 9): the parsers of job-written files never raise, every
read of one is bounded, the wrapper's bookkeeping is out of the job's reach, and what the
job started outside its process group dies with it. Shell snippets run in a real /bin/sh
with a temp $HOME, as on a VM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.control import json_safe, progress_view
from scheduler.remote.kill import kill_script, parse_kill
from scheduler.remote.launch import (
    CANNOT_START_FILE,
    ENTRY_BROKEN_MARK,
    LaunchSpec,
    launch_input,
    launch_script,
    parse_launch,
)
from scheduler.remote.layout import Attempt, default_output_dir
from scheduler.remote.output import as_int, pid_check_lines
from scheduler.remote.probe import (
    LOG_TAIL_BYTES,
    ProgressPoint,
    RemoteJobState,
    parse_progress,
    parse_status,
    status_probe,
)
from scheduler.remote.watchdog import FENCED_FILE
from scheduler.transport import LocalTransport, TransportError, VMTarget
from scheduler.validate import env_key_problem
from tests.workloads.fake_train import HOSTILE_PROGRESS
from tests.workloads.support import FAKE_TRAIN, alive, wait_file

LOCAL = VMTarget(id=1, name="local", host="localhost", transport="local")
INSTALLATION = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
TOKEN = "fedcba9876543210"


def run(job_id: int, attempt: int = 1) -> Attempt:
    """Attempt `attempt` of job `job_id` of the test installation."""
    return Attempt(INSTALLATION, job_id, attempt, TOKEN)


def spec(job_id: int = 7, **over: object) -> LaunchSpec:
    """A launch of the stand-in workload, with overrides."""
    base: dict[str, object] = {
        "run": run(job_id),
        "python": sys.executable,
        "entrypoint": str(FAKE_TRAIN),
        "gpu_indices": [0],
        "model": "m",
        "dataset": "d",
        "reward_functions": ["format"],
        "output_dir": default_output_dir(INSTALLATION, job_id),
    }
    base.update(over)
    return LaunchSpec(**base)  # type: ignore[arg-type]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's $HOME: the VM's home for the local shell."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


async def sh(command: str, timeout: float = 20, input: str | None = None) -> tuple[int, str, str]:
    """Run a snippet in /bin/sh the way a VM would."""
    result = await LocalTransport().run(LOCAL, command, timeout=timeout, input=input)
    return result.exit_status, result.stdout, result.stderr


async def probe(*runs: Attempt, timeout: float = 10) -> dict[tuple[int, int], RemoteJobState]:
    """One status probe of `runs`, parsed."""
    code, out, err = await sh(status_probe(runs), timeout=timeout)
    assert code == 0, err
    return parse_status(out)


# --- the parsers: whatever the file holds, they return --------------------------------------

HOSTILE_TEXTS = [
    *HOSTILE_PROGRESS,
    b"[" * 100_000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"step": ' + b"1" * 4301 + b"}",
    b"\xff\xfe\xfd",
    b"",
    b"\x00" * 2048,
]


@pytest.mark.parametrize("data", HOSTILE_TEXTS, ids=range(len(HOSTILE_TEXTS)))
def test_no_job_written_json_makes_a_parser_raise(data: bytes) -> None:
    """Deep nesting (RecursionError), a number of more digits than int() converts
    (ValueError), invalid UTF-8, NaN, binary: the poll's parser finds no progress in any,
    `job show` says the file is unreadable or shows values that print and serve as strict
    JSON, and none raises."""
    text = data.decode("utf-8", errors="replace")  # what the transports hand over
    point = parse_progress(text)
    assert point is None or 0 <= point.step < 2**31
    for raw in (data, text):
        view, why = progress_view(raw if isinstance(raw, bytes) else raw.encode())
        assert (view is None) != (why is None)
        json.dumps(view, allow_nan=False)  # what the job API does with it (Starlette)


def test_a_diverged_loss_is_shown_as_no_value_not_as_an_error() -> None:
    """NaN and infinity (a loss that diverged) become None in `job show`; the rest stays."""
    view, why = progress_view(
        b'{"step": 4, "loss": NaN, "reward": Infinity, "status": "run\\u001b[2J"}'
    )
    assert why is None and view == {"step": 4, "loss": None, "reward": None, "status": "run[2J"}
    assert parse_progress('{"step": 4, "loss": NaN}') == ProgressPoint(4, None, None)


def test_json_safe_bounds_depth_and_numbers() -> None:
    """Values nested deeper than SAFE_DEPTH, huge integers and control characters go."""
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    assert json.dumps(json_safe({"d": deep, "n": 10**30, "k\x00": "a\x07b"}))
    assert json_safe({"n": 10**30, "k\x00": "a\x07b"}) == {"n": None, "k": "ab"}


@pytest.mark.parametrize("text", ["9" * 19, "9" * 5000, "-" + "1" * 30])
def test_a_number_too_long_to_be_a_pid_or_an_exit_code_is_not_read(text: str) -> None:
    """`as_int` reads ids, pids and exit codes: 5,000 digits would raise in int()."""
    assert as_int(text) is None
    assert as_int("9" * 18) == int("9" * 18)


def test_the_status_parser_survives_whatever_the_attempts_files_held() -> None:
    """Exit codes that are words, too long or out of range make the attempt `exited`
    without an exit code, marked `bad_exit_code` (the job's failure, counted);
    NUL and escapes are gone from the log tail (it may become a reason in the database),
    which keeps only its last lines; nested progress is no progress."""
    out = "\n".join(
        [
            "rlfleet-job 1 1 exited garbage",
            "rlfleet-job 2 1 exited " + "9" * 30,
            "rlfleet-job 3 1 exited 300",
            "rlfleet-job 4 1 exited 0",
            *[f"rlfleet-log 4 1 line {n}\x00\x1b[2J" for n in range(50)],
            "rlfleet-progress 4 1 " + "[" * 2040,
            "rlfleet-fenced 4 1 why\x00\x1b",
            "rlfleet-job 5 1 exited 127",
            "rlfleet-cannot-start 5 1",
            "rlfleet-job " + "9" * 5000 + " 1 running",
        ]
    )
    states = parse_status(out)
    assert [states[(i, 1)].state for i in (1, 2, 3)] == ["exited"] * 3
    assert all(states[(i, 1)].bad_exit_code and states[(i, 1)].exit_code is None for i in (1, 2, 3))
    assert not states[(4, 1)].bad_exit_code
    four = states[(4, 1)]
    assert (four.state, four.exit_code, four.progress, four.fenced) == ("exited", 0, None, "why")
    assert four.log_tail.splitlines() == [f"line {n}[2J" for n in range(30, 50)]
    assert states[(5, 1)].cannot_start and not four.cannot_start


# --- the probe: bounded reads, nothing that blocks ------------------------------------------


def ended(home: Path, job_id: int, code: str = "0") -> Path:
    """An attempt directory whose wrapper has ended with `code` (its pid is dead)."""
    d = home / run(job_id).relative
    d.mkdir(parents=True)
    done = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    (d / "pid").write_text(done.stdout)
    (d / "exit_code").write_text(f"{code}\n")
    return d


@pytest.mark.slow
async def test_a_sparse_log_without_newlines_costs_the_probe_nothing(home: Path) -> None:
    """Given an ended attempt whose train.log is 100 GB (sparse: no disk used) without a
    newline, the probe reads only its last bytes: it answers within its deadline, with a
    bounded tail. (`tail -n 20` read such a file to its end.)"""
    d = ended(home, 7)
    with open(d / "train.log", "wb") as log:
        log.truncate(100 << 30)
    states = await probe(run(7), timeout=10)
    assert states[(7, 1)].state == "exited" and states[(7, 1)].exit_code == 0
    assert len(states[(7, 1)].log_tail) <= LOG_TAIL_BYTES


@pytest.mark.parametrize("name", ["train.log", "progress.json", "exit_code", "pid", "lease"])
async def test_a_fifo_in_the_attempt_directory_does_not_block_the_probe(
    home: Path, name: str
) -> None:
    """A job may replace any file of its directory by a FIFO, whose open would wait for a
    writer: the probe never opens one (the lease is opened read-write, which does not
    wait), and answers."""
    d = ended(home, 8)
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    try:
        states = await probe(run(8), timeout=5)
    except TransportError as exc:
        pytest.fail(f"the probe blocked on a FIFO {name}: {exc}")
    assert (8, 1) in states


# --- an exit code is accepted only from an attempt whose wrapper has ended -------------------


@pytest.mark.slow
async def test_an_exit_code_forged_beside_a_live_wrapper_is_not_accepted(home: Path) -> None:
    """Given a running attempt into whose exit_code someone else (another job of the same
    VM account) wrote 0, the probe still sees it running and a kill still kills it; once
    the wrapper has really ended, its own exit code is the one read."""
    launch = spec(7, extra_args=["--fake_seconds", "30"])
    result = parse_launch((await sh(launch_script(launch)))[1])
    assert result is not None
    d = home / run(7).relative
    try:
        (d / "exit_code").write_text("0\n")
        assert (await probe(run(7)))[(7, 1)].state == "running"
        code, out, _ = await sh(kill_script(run(7), grace_s=5))
        assert code == 0 and parse_kill(out) == "terminated", out
        assert not alive(result.pid)
        state = (await probe(run(7)))[(7, 1)]
        assert (state.state, state.exit_code) == ("exited", 143)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(result.pid, signal.SIGKILL)


# Only values whose signalling stays inside the kill's own process group are run here: a kill
# of "-1" (a pid file saying 1) reaches every process of the account (as root: of the
# machine), which a broken kill script must not get to do to the test run.
@pytest.mark.parametrize("pid", ["0", "00", "12abc", "x" * 100])
async def test_a_pid_file_that_names_no_plausible_pid_is_never_signalled(
    home: Path, pid: str
) -> None:
    """The pid file is the job's to write: `kill -TERM -0` would reach the kill's own
    group, `-1` every process of the account. Such a pid is never signalled."""
    d = home / run(9).relative
    d.mkdir(parents=True)
    (d / "pid").write_text(pid + "\n")
    code, out, _ = await sh(kill_script(run(9), grace_s=0.3))
    assert code == 0 and parse_kill(out) == "gone", out
    assert (await probe(run(9)))[(9, 1)].state == "vanished"


@pytest.mark.parametrize("pid", ["1", "-1", "1 2", "0", " 5"])
def test_the_pid_check_refuses_what_would_signal_more_than_the_attempt(pid: str) -> None:
    """`pid_check_lines` empties a pid of 0, 1, a negative or several words (checked in sh
    without signalling anything)."""
    script = "\n".join([f"pid={shlex.quote(pid)}", *pid_check_lines("pid"), 'echo "[$pid]"'])
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    kill = kill_script(run(9))
    assert kill.index(pid_check_lines("pid")[0]) < kill.index("kill -")


# --- the job's environment never reaches the wrapper's bookkeeping ---------------------------

ENV_DUMP = """\
import json, os, sys
with open(os.path.join(os.environ["HOME"], "env.json"), "w") as f:
    json.dump(dict(os.environ), f)
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


@pytest.fixture
def env_dump(tmp_path: Path) -> str:
    """An entrypoint that writes its environment to $HOME/env.json and exits $EXIT_WITH."""
    path = tmp_path / "env_dump.py"
    path.write_text(ENV_DUMP)
    return str(path)


async def attempt_of(home: Path, launch: LaunchSpec) -> tuple[str, str, Path]:
    """Launch `launch`, wait for its end: its exit code and log, and its directory."""
    code, _, err = await sh(launch_script(launch), 30, launch_input(launch))
    assert code == 0, err
    d = home / launch.run.relative
    exit_code = (await wait_file(d / "exit_code", timeout=30)).strip()
    return exit_code, (d / "train.log").read_text(errors="replace"), d


@pytest.mark.parametrize(
    "env",
    [
        [("d", "/tmp/elsewhere")],
        [("rlfleet_sig", "TERM")],
        [("rlfleet_check", "x"), ("rc", "3"), ("n", "9")],
        [("IFS", "/"), ("PS4", "x")],
    ],
    ids=["d", "rlfleet_sig", "wrapper-variables", "IFS"],
)
async def test_a_jobs_variables_never_reach_the_wrappers_own(
    home: Path, env_dump: str, env: list[tuple[str, str]]
) -> None:
    """Given a job whose env names the wrapper's shell variables (`d` is where it writes
    the exit code, `rlfleet_sig` says it was killed), the attempt ends with its own exit
    code in its own directory, and the training got the values the job gave (but
    `rlfleet_*`, which is refused at submit and skipped on the VM)."""
    exit_code, log, _ = await attempt_of(home, spec(7, entrypoint=env_dump, env=env))
    assert exit_code == "0", log
    seen = json.loads((home / "env.json").read_text())
    for key, value in env:
        assert seen.get(key) == (None if key.startswith("rlfleet_") else value), key
    assert ENTRY_BROKEN_MARK not in log


async def test_a_jobs_rlfleet_wd_cannot_make_the_wrapper_signal_anyone(
    home: Path, env_dump: str
) -> None:
    """`rlfleet_wd` is the pid the wrapper stops its watchdog with: a job naming another
    process there must not get it signalled."""
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        env = [("rlfleet_wd", str(stranger.pid)), ("EXIT_WITH", "0")]
        exit_code, log, _ = await attempt_of(home, spec(7, entrypoint=env_dump, env=env))
        assert exit_code == "0", log
        await asyncio.sleep(0.2)
        assert stranger.poll() is None, "the job's rlfleet_wd got a process signalled"
    finally:
        stranger.kill()
        stranger.wait()


async def test_a_job_that_breaks_its_own_path_fails_itself_not_the_vm(
    home: Path, env_dump: str
) -> None:
    """Given a VM whose python is found on PATH and a job that sets PATH=/nonexistent,
    the wrapper's check (with the VM's PATH) passes, the training cannot start (127): the
    job's failure, with no `cannot_start` mark and no VM verdict in the log."""
    python = Path(sys.executable).name
    launch = spec(7, python=python, entrypoint=env_dump, env=[("PATH", "/nonexistent")])
    vm_path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    code, _, err = await sh(
        f"PATH={shlex.quote(vm_path)}; export PATH\n{launch_script(launch)}",
        30,
        launch_input(launch),
    )
    assert code == 0, err
    d = home / launch.run.relative
    exit_code = (await wait_file(d / "exit_code", timeout=30)).strip()
    log = (d / "train.log").read_text(errors="replace")
    assert exit_code == "127", log
    assert ENTRY_BROKEN_MARK not in log
    assert not (d / CANNOT_START_FILE).exists()
    state = (await probe(launch.run))[(7, 1)]
    assert (state.state, state.exit_code, state.cannot_start) == ("exited", 127, False)


async def test_the_wrappers_own_check_marks_the_vm_and_a_job_cannot_forge_the_mark(
    home: Path, env_dump: str
) -> None:
    """A python the VM lacks: the wrapper's check fails, 127 with the `cannot_start`
    mark. A training that creates the mark itself and exits 127 has it removed."""
    broken = spec(7, python="/nonexistent/python3")
    exit_code, _, d = await attempt_of(home, broken)
    assert exit_code == "127" and (d / CANNOT_START_FILE).exists()
    assert (await probe(broken.run))[(7, 1)].cannot_start

    forger = home / "forger.py"
    forger.write_text(
        "import os, pathlib, sys\n"
        "d = pathlib.Path(os.environ['RLFLEET_PROGRESS_FILE']).parent\n"
        "(d / 'cannot_start').write_text('127')\n"
        "sys.exit(127)\n"
    )
    forged = spec(8, entrypoint=str(forger))
    exit_code, _, d = await attempt_of(home, forged)
    assert exit_code == "127" and not (d / CANNOT_START_FILE).exists()
    assert not (await probe(forged.run))[(8, 1)].cannot_start


def test_job_env_names_of_the_wrappers_namespace_are_refused() -> None:
    """`rlfleet_*` in any case is the scheduler's; `d`, `PATH` and the like are the job's."""
    assert env_key_problem("rlfleet_sig") is not None
    assert env_key_problem("Rlfleet_wd") is not None
    for key in ("d", "rc", "PATH", "IFS"):
        assert env_key_problem(key) is None


# --- what the job started outside its process group dies with it -----------------------------


@pytest.mark.slow
async def test_a_setsid_child_of_the_job_is_killed_with_it(home: Path) -> None:
    """Given a job that started a process in a session of its own (out of the attempt's
    process group), a kill of the attempt stops that process too."""
    launch = spec(7, extra_args=["--fake_seconds", "30", "--fake_setsid_child"])
    result = parse_launch((await sh(launch_script(launch)))[1])
    assert result is not None
    out_dir = home / ".rlfleet" / INSTALLATION / "outputs" / "7"
    child = int(await wait_file(out_dir / "setsid_child.pid"))
    try:
        assert os.getpgid(child) != result.pid, "the child did not leave the group"
        code, out, _ = await sh(kill_script(run(7), grace_s=5))
        assert code == 0 and parse_kill(out) == "terminated", out
        assert not alive(child), "the setsid child survived the kill"
    finally:
        for pid in (child, result.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
async def test_a_setsid_child_is_killed_even_after_the_job_ended(home: Path) -> None:
    """Given a job that ended (exit code written) leaving a setsid child behind (a VM
    without a cgroup for it: with one, the wrapper's end kills it, tests/unit/test_cgroup.py),
    a kill of the attempt (cancel, leftover sweep) reports it gone and kills the child."""
    (home / ".rlfleet").mkdir(exist_ok=True)
    (home / ".rlfleet" / "env").write_text("RLFLEET_CGROUP_ROOT=none\n")
    launch = spec(7, extra_args=["--fake_setsid_child"])
    exit_code, _, _ = await attempt_of(home, launch)
    assert exit_code == "0"
    child = int(
        (home / ".rlfleet" / INSTALLATION / "outputs" / "7" / "setsid_child.pid").read_text()
    )
    try:
        assert alive(child)
        code, out, _ = await sh(kill_script(run(7), grace_s=1))
        assert code == 0 and parse_kill(out) == "gone", out
        await asyncio.sleep(0.1)
        assert not alive(child), "the setsid child survived the kill"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
async def test_a_fence_stops_a_setsid_child_of_the_job_too(home: Path) -> None:
    """Given a job with a setsid child whose lease is never renewed (the scheduler lost
    the VM), its watchdog fences it: the training and the child outside its group stop."""
    launch = spec(
        7,
        extra_args=["--fake_seconds", "60", "--fake_setsid_child"],
        fence_after_s=1,
        fence_grace_s=1,
    )
    result = parse_launch((await sh(launch_script(launch)))[1])
    assert result is not None
    out_dir = home / ".rlfleet" / INSTALLATION / "outputs" / "7"
    child = int(await wait_file(out_dir / "setsid_child.pid"))
    try:
        await wait_file(home / run(7).relative / FENCED_FILE, timeout=30)
        for pid in (result.pid, child):
            for _ in range(300):
                if not alive(pid):
                    break
                await asyncio.sleep(0.05)
            assert not alive(pid), f"{pid} survived the fence"
    finally:
        for pid in (child, result.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_a_kill_leaves_the_same_attempt_of_another_vm_on_the_same_host_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given two VMs that are one host and account (two homes: the test fleet, or two VM
    entries for one machine), the ranks of one attempt have the same relative directory:
    a kill of the rank in one home stops what carries that home's marker, never the rank
    running from the other home."""
    here, there = tmp_path / "vm-a", tmp_path / "vm-b"
    attempt = run(7)
    for home_dir in (here, there):  # an attempt that ended, leaving a process behind
        (home_dir / attempt.relative).mkdir(parents=True)
        (home_dir / attempt.relative / "pid").write_text("4194000\n")
        (home_dir / attempt.relative / "exit_code").write_text("0\n")
    procs = {
        home_dir: subprocess.Popen(
            ["sleep", "60"],
            env={
                **os.environ,
                "RLFLEET_PROGRESS_FILE": str(home_dir / attempt.relative / "progress.json"),
            },
            start_new_session=True,
        )
        for home_dir in (here, there)
    }
    try:
        monkeypatch.setenv("HOME", str(here))
        code, out, _ = await sh(kill_script(attempt, grace_s=2))
        assert code == 0 and parse_kill(out) == "gone", out
        procs[here].wait(10)
        assert procs[there].poll() is None, "the other VM's rank was killed"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(10)
