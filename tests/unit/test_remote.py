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

from scheduler.remote.kill import DEAD_KILL_OUTCOMES, kill_script, parse_kill
from scheduler.remote.launch import (
    ENTRY_BROKEN_MARK,
    FENCED_EXIT,
    LaunchSpec,
    entry_words,
    launch_script,
    parse_launch,
    train_words,
    wrapper_script,
)
from scheduler.remote.layout import Attempt, default_output_dir, home_path, new_token, parse_dir
from scheduler.remote.logs import NO_FILE_EXIT, parse_tokens, read_file_script, tokens_script
from scheduler.remote.output import parse_exit
from scheduler.remote.probe import parse_status, status_probe
from scheduler.transport import LocalTransport, VMTarget
from tests.workloads.support import FAKE_TRAIN, wait_file

LOCAL = VMTarget(id=1, name="local", host="localhost", transport="local")
INSTALLATION = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
TOKEN = "0123456789abcdef"


def run(job_id: int, attempt: int, token: str = TOKEN) -> Attempt:
    """Attempt `attempt` of job `job_id` of the test installation."""
    return Attempt(INSTALLATION, job_id, attempt, token)


def spec(**over: object) -> LaunchSpec:
    """A launch of the stand-in workload, with overrides."""
    base: dict[str, object] = {
        "run": run(7, 1),
        "python": sys.executable,
        "entrypoint": str(FAKE_TRAIN),
        "gpu_indices": [2],
        "model": "m",
        "dataset": "d",
        "reward_functions": ["format"],
        "output_dir": default_output_dir(INSTALLATION, 7),
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
    assert entry_words("py", "training.train_grpo", 1) == ["py", "-m", "training.train_grpo"]
    assert entry_words("py", "/x/t.py", 1) == ["py", "/x/t.py"]
    assert entry_words("py", "training.train_grpo", 4) == [
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
    words = train_words(spec(reward_functions=["a", "b"], extra_args=["--max_steps", "5"]))
    text = " ".join(words)
    assert text.endswith(
        "--model m --dataset d --reward_function a --reward_function b "
        '--output_dir "$HOME"/.rlfleet/'
        f"{INSTALLATION}/outputs/7 --max_steps 5"
    )
    assert train_words(spec(run=run(7, 2)))[-2:] == ["--resume", "auto"]


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
    assert home_path(path) == word


async def test_hostile_arguments_reach_the_program_verbatim(home: Path) -> None:
    """Given arguments full of shell syntax (and a heredoc-looking line), when launched,
    then the training program receives them byte for byte and nothing else runs."""
    evil = ["$(touch pwned)", "`touch pwned`", "a;touch pwned", "x\nEOF\ntouch pwned\n", "'\""]
    launch = spec(model="$(touch pwned)", extra_args=evil)
    code, out, err = await sh(launch_script(launch))
    assert code == 0, err
    log = home / run(7, 1).relative / "train.log"
    await wait_file(home / run(7, 1).relative / "exit_code")
    args_line = next(line for line in log.read_text().splitlines() if "args=" in line)
    # fake_train prints repr(sys.argv[1:]); every hostile string is there intact.
    for piece in evil:
        assert repr(piece) in args_line
    assert not (home / "pwned").exists()


@pytest.mark.slow
async def test_launch_runs_detached_with_contract_files(home: Path) -> None:
    """Given a launch, then pid, train.log, progress.json, launch.sh and exit_code appear,
    CUDA_VISIBLE_DEVICES names the claimed GPUs and the pid leads its own process group."""
    code, out, err = await sh(launch_script(spec(gpu_indices=[1, 3])))
    assert code == 0, err
    result = parse_launch(out)
    assert result is not None
    d = home / run(7, 1).relative
    assert int((d / "pid").read_text()) == result.pid
    assert (await wait_file(d / "exit_code")).strip() == "0"
    assert "CUDA_VISIBLE_DEVICES=1,3" in (d / "train.log").read_text()
    assert json.loads((d / "progress.json").read_text())["status"] == "finished"
    assert (d / "launch.sh").exists()
    assert (home / ".rlfleet" / INSTALLATION / "outputs/7").is_dir()


async def test_launch_is_idempotent_per_attempt(home: Path) -> None:
    """Given a running attempt, when the launch is repeated, then the same pid is reported
    and only one process ever started."""
    launch = spec(extra_args=["--fake_seconds", "30"])
    first = parse_launch((await sh(launch_script(launch)))[1])
    assert first is not None
    try:
        second = parse_launch((await sh(launch_script(launch)))[1])
        assert second is not None
        assert first.pid == second.pid
        log = (home / run(7, 1).relative / "train.log").read_text()
        assert log.count("attempt started") == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)


async def test_exit_code_is_recorded(home: Path) -> None:
    """The wrapper records the training process's exit status."""
    await sh(launch_script(spec(extra_args=["--fake_exit", "3"])))
    assert (await wait_file(home / run(7, 1).relative / "exit_code")).strip() == "3"


@pytest.mark.slow
async def test_kill_terminates_the_group_and_records_the_signal(home: Path) -> None:
    """Given a long attempt, when killed, then the group is gone, exit_code says 143
    (128 + TERM) and killing again is harmless."""
    launch = spec(extra_args=["--fake_seconds", "30"])
    result = parse_launch((await sh(launch_script(launch)))[1])
    assert result is not None
    code, out, _ = await sh(kill_script(run(7, 1), grace_s=5))
    assert code == 0
    assert parse_kill(out) == "terminated"
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pid, 0)
    assert (await wait_file(home / run(7, 1).relative / "exit_code")).strip() == "143"
    assert parse_kill((await sh(kill_script(run(7, 1))))[1]) == "gone"


async def test_a_kill_before_the_launch_fences_it_off(home: Path) -> None:
    """Given an attempt killed before its launch arrived, the kill says `fenced`, the late
    launch starts nothing and exits FENCED_EXIT at once, and killing again still says
    `fenced` (it never ran)."""
    code, out, _ = await sh(kill_script(run(7, 1)))
    assert (code, parse_kill(out)) == (0, "fenced")
    started = time.monotonic()
    code, out, err = await sh(launch_script(spec(extra_args=["--fake_seconds", "30"])))
    assert code == FENCED_EXIT, err
    assert parse_launch(out) is None
    assert "killed before it started" in err
    assert time.monotonic() - started < 5, "the launch waited out its pid timeout"
    d = home / run(7, 1).relative
    assert not (d / "pid").exists() and not (d / "train.log").exists()
    assert parse_kill((await sh(kill_script(run(7, 1))))[1]) == "fenced"


@pytest.mark.slow
async def test_a_kill_during_the_launch_waits_for_the_pid(home: Path) -> None:
    """Given a launch that holds the lock but has not written its pid yet, the kill waits
    for the pid and then kills the group: it never reports a launch as not started while
    the launch may still start it."""
    d = home / run(8, 1).relative
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
    code, out, _ = await sh(kill_script(run(8, 1), grace_s=2))
    assert parse_kill(out) == "terminated"
    with pytest.raises(ProcessLookupError):
        os.killpg(int((d / "pid").read_text()), 0)


async def test_a_launch_that_never_writes_its_pid_is_nopid(home: Path) -> None:
    """Given a lock held with no pid ever written, the kill gives up after its wait and
    says `nopid`, an outcome that does not count as dead."""
    (home / run(9, 1).relative / ".launch.lock").mkdir(parents=True)
    code, out, _ = await sh(kill_script(run(9, 1), pid_wait_s=0.3))
    assert (code, parse_kill(out)) == (0, "nopid")
    assert "nopid" not in DEAD_KILL_OUTCOMES


async def test_kill_escalates_to_kill_after_grace(home: Path) -> None:
    """A process that ignores TERM is KILLed after the grace period."""
    d = home / run(8, 1).relative
    d.mkdir(parents=True)
    script = "trap '' TERM; echo $$ > " + shlex.quote(str(d / "pid")) + "; sleep 30"
    await sh(f"setsid sh -c {shlex.quote(script)} </dev/null >/dev/null 2>&1 &")
    await wait_file(d / "pid")
    code, out, _ = await sh(kill_script(run(8, 1), grace_s=0.3))
    assert parse_kill(out) == "killed"
    assert (d / "exit_code").read_text().strip() == "137"


async def test_read_file_from_offset(home: Path) -> None:
    """Logs are read from a byte offset; a missing file is exit 3."""
    d = home / run(9, 2).relative
    d.mkdir(parents=True)
    (d / "train.log").write_text("hello world\n")
    assert (await sh(read_file_script(run(9, 2), "train.log", offset=6)))[1] == "world\n"
    assert (await sh(read_file_script(run(9, 3), "train.log")))[0] == NO_FILE_EXIT


async def test_kill_of_an_ended_attempt_signals_nobody(home: Path) -> None:
    """Once the attempt wrote its exit code, its pid may be someone else's: left alone."""
    d = home / run(10, 1).relative
    d.mkdir(parents=True)
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        (d / "pid").write_text(f"{stranger.pid}\n")
        (d / "exit_code").write_text("0\n")
        code, out, _ = await sh(kill_script(run(10, 1), grace_s=0.3))
        assert code == 0 and parse_kill(out) == "gone"
        assert stranger.poll() is None, "an unrelated process group was signalled"
    finally:
        stranger.kill()
        stranger.wait()


# --- invariant 6: one directory per installation and attempt ----------------------------

OTHER_INSTALLATION = "9f0c1e2d-3b4a-4c5d-8e6f-708192a3b4c5"


def test_attempt_directory_names_installation_job_attempt_and_token() -> None:
    """The directory is `.rlfleet/<installation>/jobs/<id>/<attempt>-<token>`; outputs
    default to a per-installation, per-job directory."""
    assert run(7, 2).relative == f".rlfleet/{INSTALLATION}/jobs/7/2-{TOKEN}"
    assert run(7, 2).word() == f'"$HOME"/.rlfleet/{INSTALLATION}/jobs/7/2-{TOKEN}'
    assert default_output_dir(INSTALLATION, 7) == f"~/.rlfleet/{INSTALLATION}/outputs/7"
    assert len(new_token()) == 16 and new_token() != new_token()


@pytest.mark.parametrize(
    "fields",
    [
        {"installation": "not-a-uuid"},
        {"installation": INSTALLATION.upper()},
        {"token": "0123"},
        {"token": "0123456789abcdeX"},
        {"token": "'; rm -rf ~; '0000"},
        {"job_id": 0},
        {"attempt": 0},
        {"path": "relative/dir"},
        {"path": f"/home/u/.rlfleet/{INSTALLATION}/jobs/7/1-fedcba9876543210"},
        {"path": f"/x\n/.rlfleet/{INSTALLATION}/jobs/7/1-{TOKEN}"},
    ],
)
def test_attempt_refuses_anything_that_is_not_its_own_name(fields: dict[str, object]) -> None:
    """Every part of the name is checked before it goes into shell text: a malformed id
    or token, or a recorded directory that is not this attempt's, is a ValueError."""
    base: dict[str, object] = {
        "installation": INSTALLATION,
        "job_id": 7,
        "attempt": 1,
        "token": TOKEN,
    }
    with pytest.raises(ValueError):
        Attempt(**{**base, **fields})  # type: ignore[arg-type]


def test_a_recorded_directory_is_one_quoted_word() -> None:
    """A recorded absolute directory is used as is, quoted, whatever it holds."""
    path = f"/home/o'dd $user/.rlfleet/{INSTALLATION}/jobs/7/1-{TOKEN}"
    located = run(7, 1).located(path)
    assert located.path == path
    assert shlex.split(located.word()) == [path]
    assert run(7, 1).located("/elsewhere/x").path is None


async def test_leftovers_of_other_installations_and_old_layouts_are_never_adopted(
    home: Path,
) -> None:
    """Given, for job 7 attempt 1, the old layout's files (lock, pid, exit 126), another
    installation's and another claim's finished directories, when this attempt launches,
    then it really runs (a new process that writes its own exit code 0), reports its own
    absolute directory, and the others' files are untouched."""
    stale = []
    for rel in (
        ".rlfleet/jobs/7/1",
        Attempt(OTHER_INSTALLATION, 7, 1, TOKEN).relative,
        run(7, 1, token="fedcba9876543210").relative,
    ):
        d = home / rel
        (d / ".launch.lock").mkdir(parents=True)
        (d / "pid").write_text("1\n")
        (d / "exit_code").write_text("126\n")
        stale.append(d)
    code, out, err = await sh(launch_script(spec(extra_args=["--fake_exit", "0"])))
    assert code == 0, err
    result = parse_launch(out, run(7, 1))
    # A fast machine may see the new run end before the launch script looks: then the
    # exit code it reports is the run's own 0, never the old 126.
    assert result is not None and result.pid != 1 and result.exit_code in (None, 0)
    assert result.path == str(home / run(7, 1).relative)
    assert (await wait_file(Path(result.path) / "exit_code")).strip() == "0"
    assert "fake_train: args=" in (Path(result.path) / "train.log").read_text()
    for d in stale:
        assert (d / "exit_code").read_text() == "126\n" and not (d / "train.log").exists()
    probe = parse_status((await sh(status_probe([run(7, 1, "aaaaaaaaaaaaaaaa")])))[1])
    assert probe[(7, 1)].state == "unknown", "another token's exit code was taken"


@pytest.mark.slow
async def test_kill_uses_the_recorded_directory_whatever_home_the_caller_has(
    home: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an attempt launched under one $HOME, when it is killed by a shell whose $HOME
    differs, with the directory the launch recorded, then its group is terminated; and an
    attempt whose launch was confirmed is never reported fenced (`missing` instead)."""
    launch = spec(extra_args=["--fake_seconds", "30"])
    result = parse_launch((await sh(launch_script(launch)))[1], launch.run)
    assert result is not None and result.path is not None
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("other-home")))
    try:
        missing = await sh(kill_script(launch.run, grace_s=1, launched=True))
        assert parse_kill(missing[1]) == "missing"
        assert "missing" not in DEAD_KILL_OUTCOMES
        here = launch.run.located(result.path)
        code, out, _ = await sh(kill_script(here, grace_s=5, launched=True))
        assert (code, parse_kill(out)) == (0, "terminated")
        with pytest.raises(ProcessLookupError):
            os.killpg(result.pid, 0)
        again = (await sh(kill_script(here, launched=True)))[1]
        assert parse_kill(again) == "gone"
        assert parse_exit(again) == 143
        assert parse_dir(again, here) == result.path
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(result.pid, signal.SIGKILL)


async def test_read_file_as_hex_gives_the_exact_bytes(home: Path) -> None:
    """A log with invalid UTF-8 and a character cut in half comes back byte for byte,
    from a byte offset, at most `limit` bytes."""
    d = home / run(9, 2).relative
    d.mkdir(parents=True)
    data = b"ok \xff\xfe caf\xc3"
    (d / "train.log").write_bytes(data)
    out = (await sh(read_file_script(run(9, 2), "train.log", offset=3, hex=True)))[1]
    assert bytes.fromhex(out) == data[3:]
    out = (await sh(read_file_script(run(9, 2), "train.log", hex=True, limit=4)))[1]
    assert bytes.fromhex(out) == data[:4]


async def test_tokens_of_an_attempt_are_listed_for_this_installation_only(home: Path) -> None:
    """`job logs --attempt N` finds attempt N's directory of this installation, never
    another installation's nor another attempt's."""
    for a in (
        run(7, 1),
        run(7, 2, "bbbbbbbbbbbbbbbb"),
        Attempt(OTHER_INSTALLATION, 7, 1, "c" * 16),
    ):
        (home / a.relative).mkdir(parents=True)
    out = (await sh(tokens_script(INSTALLATION, 7, 1)))[1]
    assert parse_tokens(out) == [TOKEN]
    assert parse_tokens((await sh(tokens_script(INSTALLATION, 8, 1)))[1]) == []


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
    await sh(launch_script(spec(python=python, entrypoint=entrypoint)))
    d = home / run(7, 1).relative
    assert (await wait_file(d / "exit_code")).strip() == code
    verdict = [
        line
        for line in (d / "train.log").read_text().splitlines()
        if line.startswith(ENTRY_BROKEN_MARK)
    ]
    assert len(verdict) == 1 and says in verdict[0], verdict


async def test_an_attempt_runs_on_the_uuids_it_was_given_in_pci_bus_order(home: Path) -> None:
    """CUDA_VISIBLE_DEVICES names the claimed GPUs by UUID; CUDA_DEVICE_ORDER is
    PCI_BUS_ID for tools that read indices."""
    uuids = ["GPU-5d2ad6c4-d5a1-8a4b-1b1d-0c4e7c1b8e50", "GPU-9e1f0a3b-2c4d-4e5f-8a9b-0c1d"]
    launch = spec(gpu_indices=[3, 1], gpu_uuids=uuids, python=sys.executable)
    script = wrapper_script(launch)
    assert f"export CUDA_VISIBLE_DEVICES={','.join(uuids)}\n" in script
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in script
