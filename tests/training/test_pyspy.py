"""A real `py-spy dump` of the tiny-model train_grpo.py, taken by the diagnostics command
rlfleet runs on a VM before stopping a hung attempt (`remote.diagnostics`): a run whose
reward function blocks after the first step (a deadlocked rollout) shows its stacks, down
to the blocked reward, with the end of its log."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.remote.diagnostics import diagnostics_script, parse_diagnostics
from scheduler.remote.layout import Attempt
from tests.training.helpers import _env, tiny_run_args

pytestmark = pytest.mark.slow

STUCK_REWARD = """
import threading

calls = []


def stuck_reward(prompts, completions, **kwargs):
    calls.append(1)
    if len(calls) > 1:
        threading.Event().wait()  # a rollout waiting for an answer that never comes
    return [0.0 for _ in completions]
"""
INSTALLATION = "8ecee215-6897-4b04-b858-5f093b6805ac"


def wait_step(path: Path, step: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no step {step} in {deadline_s}s")


@pytest.mark.skipif(
    shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None,
    reason="py-spy is not installed beside this python (pip install 'rlfleet[train]')",
)
def test_the_diagnostics_of_a_stuck_train_grpo_hold_its_python_stacks(
    tiny_model: Path, tmp_path: Path
) -> None:
    run = Attempt(INSTALLATION, 7, 1, "0123456789abcdef")
    directory = tmp_path / "home" / run.relative
    directory.mkdir(parents=True)
    run = run.located(str(directory))
    (tmp_path / "stuck.py").write_text(STUCK_REWARD)
    args = tiny_run_args(tiny_model, tmp_path / "out", "--max_steps", "5", "--save_steps", "1000")
    args += ["--reward_function", "stuck:stuck_reward"]
    env = _env({"RLFLEET_PROGRESS_FILE": str(directory / "progress.json")})
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    with open(directory / "train.log", "w") as log:
        # A session of its own, as a launch's wrapper has: its pid leads its process group.
        process = subprocess.Popen(
            [sys.executable, "-m", "training.train_grpo", *args],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        (directory / "pid").write_text(f"{process.pid}\n")
        wait_step(directory / "progress.json", 0, deadline_s=240)
        time.sleep(3)  # into the second reward call, where it blocks for good
        assert process.poll() is None, (directory / "train.log").read_text()[-2000:]
        script = diagnostics_script(run, sys.executable, "hung: step 1 unchanged")
        done = subprocess.run(
            ["sh", "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the group this test created
        process.wait()
    content = parse_diagnostics(done.stdout)
    assert content is not None, done.stdout[-2000:] + done.stderr[-2000:]
    assert content == (directory / "diagnostics.txt").read_text().rstrip("\n") + "\n" or (
        content in (directory / "diagnostics.txt").read_text()
    )
    assert "reason: hung: step 1 unchanged" in content
    assert f"== process {process.pid}: " in content
    # py-spy's dump: the main thread inside the trainer, down to the blocked reward.
    for frame in ("stuck_reward (stuck.py:", "train_grpo.py:", "Thread "):
        assert frame in content, (frame, content[-4000:])
    assert "== end of train.log" in content
