"""The VM-side shell snippets, built as text and run in a real /bin/sh with a temp $HOME."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler import remote
from scheduler.remote import LaunchSpec
from scheduler.transport import LocalTransport, VMTarget
from tests.workloads.support import FAKE_TRAIN, wait_file

LOCAL = VMTarget(id=1, name="local", host="localhost", transport="local")


def spec(**over: object) -> LaunchSpec:
    """A launch of the stand-in workload, with overrides."""
    base: dict[str, object] = {
        "job_id": 7,
        "attempt": 1,
        "python": sys.executable,
        "entrypoint": str(FAKE_TRAIN),
        "gpu_indices": [2],
        "model": "m",
        "dataset": "d",
        "reward_functions": ["format"],
        "output_dir": remote.default_output_dir(7),
        "extra_args": [],
    }
    base.update(over)
    return LaunchSpec(**base)  # type: ignore[arg-type]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's $HOME: the VM's home for the local shell."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


async def sh(command: str, timeout: float = 20) -> tuple[int, str, str]:
    """Run a snippet in /bin/sh the way a VM would."""
    result = await LocalTransport().run(LOCAL, command, timeout=timeout)
    return result.exit_status, result.stdout, result.stderr


def test_entry_words_follow_contract_5() -> None:
    """A .py entrypoint is a script, anything else a module; N > 1 GPUs go via accelerate."""
    assert remote.entry_words("py", "training.train_grpo", 1) == ["py", "-m", "training.train_grpo"]
    assert remote.entry_words("py", "/x/t.py", 1) == ["py", "/x/t.py"]
    assert remote.entry_words("py", "training.train_grpo", 4) == [
        "py",
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "4",
        "-m",
        "training.train_grpo",
    ]


def test_train_words_order_and_resume() -> None:
    """Model, dataset, one flag per reward, output dir, extra args verbatim; resume after 1."""
    words = remote.train_words(
        spec(reward_functions=["a", "b"], extra_args=["--max_steps", "5"], attempt=1)
    )
    text = " ".join(words)
    assert text.endswith(
        "--model m --dataset d --reward_function a --reward_function b "
        '--output_dir "$HOME"/.rlfleet/outputs/7 --max_steps 5'
    )
    assert remote.train_words(spec(attempt=2))[-2:] == ["--resume", "auto"]


@pytest.mark.parametrize(
    ("path", "word"),
    [
        ("~/out", '"$HOME"/out'),
        ("rel dir", "\"$HOME\"/'rel dir'"),
        ("/abs/$x", "'/abs/$x'"),
    ],
)
def test_home_path_quotes(path: str, word: str) -> None:
    """Paths under ~ expand $HOME and nothing else."""
    assert remote.home_path(path) == word


async def test_hostile_arguments_reach_the_program_verbatim(home: Path) -> None:
    """Given arguments full of shell syntax (and a heredoc-looking line), when launched,
    then the training program receives them byte for byte and nothing else runs."""
    evil = ["$(touch pwned)", "`touch pwned`", "a;touch pwned", "x\nEOF\ntouch pwned\n", "'\""]
    launch = spec(model="$(touch pwned)", extra_args=evil)
    code, out, err = await sh(remote.launch_script(launch))
    assert code == 0, err
    log = home / remote.job_dir(7, 1) / "train.log"
    await wait_file(home / remote.job_dir(7, 1) / "exit_code")
    args_line = next(line for line in log.read_text().splitlines() if "args=" in line)
    # fake_train prints repr(sys.argv[1:]); every hostile string is there intact.
    for piece in evil:
        assert repr(piece) in args_line
    assert not (home / "pwned").exists()


async def test_launch_runs_detached_with_contract_files(home: Path) -> None:
    """Given a launch, then pid, train.log, progress.json, launch.sh and exit_code appear,
    CUDA_VISIBLE_DEVICES names the claimed GPUs and the pid leads its own process group."""
    code, out, err = await sh(remote.launch_script(spec(gpu_indices=[1, 3])))
    assert code == 0, err
    result = remote.parse_launch(out)
    assert result is not None
    d = home / remote.job_dir(7, 1)
    assert int((d / "pid").read_text()) == result.pid
    assert (await wait_file(d / "exit_code")).strip() == "0"
    assert "CUDA_VISIBLE_DEVICES=1,3" in (d / "train.log").read_text()
    assert json.loads((d / "progress.json").read_text())["status"] == "finished"
    assert (d / "launch.sh").exists()
    assert (home / ".rlfleet/outputs/7").is_dir()


async def test_launch_is_idempotent_per_attempt(home: Path) -> None:
    """Given a running attempt, when the launch is repeated, then the same pid is reported
    and only one process ever started."""
    launch = spec(extra_args=["--fake_seconds", "30"])
    first = remote.parse_launch((await sh(remote.launch_script(launch)))[1])
    assert first is not None
    try:
        second = remote.parse_launch((await sh(remote.launch_script(launch)))[1])
        assert second is not None
        assert first.pid == second.pid
        log = (home / remote.job_dir(7, 1) / "train.log").read_text()
        assert log.count("attempt started") == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)


async def test_exit_code_is_recorded(home: Path) -> None:
    """The wrapper records the training process's exit status."""
    await sh(remote.launch_script(spec(extra_args=["--fake_exit", "3"])))
    assert (await wait_file(home / remote.job_dir(7, 1) / "exit_code")).strip() == "3"


async def test_kill_terminates_the_group_and_records_the_signal(home: Path) -> None:
    """Given a long attempt, when killed, then the group is gone, exit_code says 143
    (128 + TERM) and killing again is harmless."""
    launch = spec(extra_args=["--fake_seconds", "30"])
    result = remote.parse_launch((await sh(remote.launch_script(launch)))[1])
    assert result is not None
    code, out, _ = await sh(remote.kill_script(7, 1, grace_s=5))
    assert code == 0
    assert remote.parse_kill(out) == "terminated"
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pid, 0)
    assert (await wait_file(home / remote.job_dir(7, 1) / "exit_code")).strip() == "143"
    assert remote.parse_kill((await sh(remote.kill_script(7, 1)))[1]) == "gone"


async def test_a_kill_before_the_launch_fences_it_off(home: Path) -> None:
    """Given an attempt killed before its launch arrived, the kill says `fenced`, the late
    launch starts nothing and exits FENCED_EXIT at once, and killing again still says
    `fenced` (it never ran)."""
    code, out, _ = await sh(remote.kill_script(7, 1))
    assert (code, remote.parse_kill(out)) == (0, "fenced")
    started = time.monotonic()
    code, out, err = await sh(remote.launch_script(spec(extra_args=["--fake_seconds", "30"])))
    assert code == remote.FENCED_EXIT, err
    assert remote.parse_launch(out) is None
    assert "killed before it started" in err
    assert time.monotonic() - started < 5, "the launch waited out its pid timeout"
    d = home / remote.job_dir(7, 1)
    assert not (d / "pid").exists() and not (d / "train.log").exists()
    assert remote.parse_kill((await sh(remote.kill_script(7, 1)))[1]) == "fenced"


async def test_a_kill_during_the_launch_waits_for_the_pid(home: Path) -> None:
    """Given a launch that holds the lock but has not written its pid yet, the kill waits
    for the pid and then kills the group: it never reports a launch as not started while
    the launch may still start it."""
    d = home / remote.job_dir(8, 1)
    (d / ".launch.lock").mkdir(parents=True)
    script = (
        "sleep 0.5; echo $$ > "
        + shlex.quote(str(d / "pid.tmp"))
        + " && mv "
        + shlex.quote(str(d / "pid.tmp"))
        + " "
        + shlex.quote(str(d / "pid"))
        + "; exec sleep 30"
    )
    await sh(f"setsid sh -c {shlex.quote(script)} </dev/null >/dev/null 2>&1 &")
    code, out, _ = await sh(remote.kill_script(8, 1, grace_s=2))
    assert remote.parse_kill(out) == "terminated"
    with pytest.raises(ProcessLookupError):
        os.killpg(int((d / "pid").read_text()), 0)


async def test_a_launch_that_never_writes_its_pid_is_nopid(home: Path) -> None:
    """Given a lock held with no pid ever written, the kill gives up after its wait and
    says `nopid`, an outcome that does not count as dead."""
    (home / remote.job_dir(9, 1) / ".launch.lock").mkdir(parents=True)
    code, out, _ = await sh(remote.kill_script(9, 1, pid_wait_s=0.3))
    assert (code, remote.parse_kill(out)) == (0, "nopid")
    assert "nopid" not in remote.DEAD_KILL_OUTCOMES


async def test_kill_escalates_to_kill_after_grace(home: Path) -> None:
    """A process that ignores TERM is KILLed after the grace period."""
    d = home / remote.job_dir(8, 1)
    d.mkdir(parents=True)
    script = "trap '' TERM; echo $$ > " + shlex.quote(str(d / "pid")) + "; sleep 30"
    await sh(f"setsid sh -c {shlex.quote(script)} </dev/null >/dev/null 2>&1 &")
    await wait_file(d / "pid")
    code, out, _ = await sh(remote.kill_script(8, 1, grace_s=0.3))
    assert remote.parse_kill(out) == "killed"
    assert (d / "exit_code").read_text().strip() == "137"


async def test_read_file_from_offset(home: Path) -> None:
    """Logs are read from a byte offset; a missing file is exit 3."""
    d = home / remote.job_dir(9, 2)
    d.mkdir(parents=True)
    (d / "train.log").write_text("hello world\n")
    assert (await sh(remote.read_file_script(9, 2, "train.log", offset=6)))[1] == "world\n"
    assert (await sh(remote.read_file_script(9, 3, "train.log")))[0] == remote.NO_FILE_EXIT


async def test_kill_of_an_ended_attempt_signals_nobody(home: Path) -> None:
    """Once the attempt wrote its exit code, its pid may be someone else's: left alone."""
    d = home / remote.job_dir(10, 1)
    d.mkdir(parents=True)
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        (d / "pid").write_text(f"{stranger.pid}\n")
        (d / "exit_code").write_text("0\n")
        code, out, _ = await sh(remote.kill_script(10, 1, grace_s=0.3))
        assert code == 0 and remote.parse_kill(out) == "gone"
        assert stranger.poll() is None, "an unrelated process group was signalled"
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize(
    ("python", "entrypoint", "code", "says"),
    [
        ("/nonexistent/python3", str(FAKE_TRAIN), "127", "not found"),
        (sys.executable, "/nonexistent/train.py", "127", "No such file or directory"),
        (sys.executable, "no_such_package.train", "127", "No module named 'no_such_package'"),
    ],
)
async def test_an_attempt_whose_python_or_entrypoint_cannot_run_exits_127_saying_why(
    home: Path, python: str, entrypoint: str, code: str, says: str
) -> None:
    """The wrapper checks the VM's python and entrypoint before training: when they
    cannot run, exit_code is 127 and the log's verdict line says why."""
    await sh(remote.launch_script(spec(python=python, entrypoint=entrypoint)))
    d = home / remote.job_dir(7, 1)
    assert (await wait_file(d / "exit_code")).strip() == code
    verdict = [
        line
        for line in (d / "train.log").read_text().splitlines()
        if line.startswith(remote.ENTRY_BROKEN_MARK)
    ]
    assert len(verdict) == 1 and says in verdict[0], verdict


async def test_an_attempt_runs_on_the_uuids_it_was_given_in_pci_bus_order(home: Path) -> None:
    """CUDA_VISIBLE_DEVICES names the claimed GPUs by UUID; CUDA_DEVICE_ORDER is
    PCI_BUS_ID for tools that read indices."""
    uuids = ["GPU-5d2ad6c4-d5a1-8a4b-1b1d-0c4e7c1b8e50", "GPU-9e1f0a3b-2c4d-4e5f-8a9b-0c1d"]
    launch = spec(gpu_indices=[3, 1], gpu_uuids=uuids, python=sys.executable)
    script = remote.wrapper_script(launch)
    assert f"export CUDA_VISIBLE_DEVICES={','.join(uuids)}\n" in script
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in script
