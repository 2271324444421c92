"""SIGTERM mid-training: the real script saves a checkpoint of the current step and exits 143;
`--resume auto` continues from that step to max_steps."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.training.helpers import start_train_grpo, tiny_run_args, train_grpo

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

# Slow enough (a fraction of a second per step) that the run is surely still training when the
# test, which polls progress.json, sends TERM: the race is lost only if this process sleeps for
# the remaining ~10 steps.
SLOW_REWARD = """
import time


def slow_length(prompts, completions, **kwargs):
    time.sleep(0.5)
    return [len(c[0]["content"]) / 40 for c in completions]
"""
MAX_STEPS = 12


def _progress(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _wait_for_step(path: Path, step: int, deadline_s: float) -> dict:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        progress = _progress(path)
        if progress and progress["step"] >= step:
            return progress
        time.sleep(0.05)
    raise AssertionError(f"no progress to step {step} in {deadline_s} s: {_progress(path)}")


def _trained_steps(checkpoint: Path) -> list[int]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [entry["step"] for entry in state["log_history"] if "reward" in entry]


@pytest.fixture
def args(tiny_model: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    # No periodic checkpoint before max_steps: the one found after the TERM is the TERM's.
    extra = ["--max_steps", str(MAX_STEPS), "--save_steps", "1000"]
    return [
        *tiny_run_args(tiny_model, tmp_path / "out", *extra),
        "--reward_function",
        "slow:slow_length",
    ]


def test_sigterm_saves_the_current_step_and_resume_continues_from_it(
    args: list[str], tmp_path: Path
):
    out = tmp_path / "out"
    process = start_train_grpo(*args, cwd=tmp_path)
    try:
        _wait_for_step(out / "progress.json", 2, deadline_s=240)
        process.send_signal(signal.SIGTERM)
        termed = time.monotonic()
        _, stderr = process.communicate(timeout=120)
        exited_after_s = time.monotonic() - termed
    finally:
        process.kill()
        process.wait()

    assert process.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    progress = json.loads((out / "progress.json").read_text())
    stopped_at = progress["step"]
    assert progress["status"] == "stopped" and 2 <= stopped_at < MAX_STEPS, progress
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{stopped_at}"]
    assert _trained_steps(out / f"checkpoint-{stopped_at}") == list(range(1, stopped_at + 1))
    assert not (out / "model.safetensors").exists(), "a stopped run saved a final model"
    assert stderr.endswith(
        f"\ntrain-grpo: stopped by SIGTERM after step {stopped_at} of {MAX_STEPS}; checkpoint "
        f"saved to {out}/checkpoint-{stopped_at} (--resume auto continues)\n"
    ), stderr[-500:]
    # Within the scheduler's 10 s grace even on a busy machine: one more step, a save, exit.
    assert exited_after_s < 10, exited_after_s

    # The retry: the same command with --resume auto, its progress in the attempt's own file.
    progress_file = tmp_path / "attempt-2" / "progress.json"
    resumed = train_grpo(
        *args, "--resume", "auto", cwd=tmp_path, env={"RLFLEET_PROGRESS_FILE": str(progress_file)}
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    progress = json.loads(progress_file.read_text())
    assert (progress["status"], progress["start_step"], progress["step"]) == (
        "finished",
        stopped_at,
        MAX_STEPS,
    )
    assert _trained_steps(out / f"checkpoint-{MAX_STEPS}") == list(range(1, MAX_STEPS + 1))
    assert f"done after {MAX_STEPS} steps" in resumed.stdout
    assert (out / "model.safetensors").is_file()
