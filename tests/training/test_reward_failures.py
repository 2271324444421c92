"""Broken reward functions inside real training steps: the real script exits 64 or 75 with its
error as the last and only error line on stderr; math_equivalence scores in a trainer thread."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.training.helpers import tiny_run_args, train_grpo

USER_REWARDS = """
import math
import socket


def _after_first_step(kwargs):
    # Fail inside training, not on the first call, as a reward that meets an odd row would.
    return kwargs["trainer_state"].global_step >= 1


def raises(prompts, completions, **kwargs):
    if _after_first_step(kwargs):
        raise KeyError("no column 'difficulty'")
    return [0.0] * len(completions)


def returns_none(prompts, completions, **kwargs):
    return None if _after_first_step(kwargs) else [0.0] * len(completions)


def one_short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def never_scores(prompts, completions, **kwargs):
    half = len(completions) // 2
    return [None] * half + [math.nan] * (len(completions) - half)


def judge_times_out(prompts, completions, **kwargs):
    raise socket.timeout("timed out")
"""

# (reward, exit code, the error line, last step progress.json recorded: the third unscored step
# ends in the error before it is logged)
CASES = [
    ("rw:raises", 64, "reward function rw:raises raised KeyError: \"no column 'difficulty'\"", 1),
    ("rw:returns_none", 64, "reward function rw:returns_none returned None instead of 4 scores", 1),
    ("rw:one_short", 64, "reward function rw:one_short returned 3 scores for 4 completions", 0),
    (
        "rw:never_scores",
        64,
        "reward functions rw:never_scores gave no score (None or NaN) to any completion "
        "for 3 steps in a row",
        2,
    ),
    (
        "rw:judge_times_out",
        75,
        "reward function rw:judge_times_out raised TimeoutError: timed out",
        0,
    ),
]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rewards")
    (root / "rw.py").write_text(USER_REWARDS)
    return root


@pytest.mark.parametrize(("reward", "code", "line", "steps"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.slow
def test_a_broken_reward_ends_training_with_its_exit_code_and_one_line(
    reward: str, code: int, line: str, steps: int, tiny_model: Path, user_dir: Path, tmp_path: Path
):
    out = tmp_path / "out"
    args = tiny_run_args(tiny_model, out, "--max_steps", "6", "--save_steps", "100")
    # Only the broken reward: the helper's keyword_match would score the steps never_scores
    # leaves unscored.
    start = args.index("--reward_function")
    args[start : start + 4] = ["--reward_function", reward]
    result = train_grpo(*args, cwd=user_dir)
    assert result.returncode == code, result.stderr[-3000:]
    err = result.stderr
    assert "Traceback" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if "train-grpo: error" in x]
    assert errors == [f"train-grpo: error: {line}"]
    # The last line: not glued to the progress bar, which must not redraw after it.
    assert err.endswith(f"\ntrain-grpo: error: {line}\n"), err[-500:]
    progress = json.loads((out / "progress.json").read_text())
    assert progress["step"] == steps and progress["status"] == "running"
    assert not (out / "model.safetensors").exists()


def test_math_equivalence_scores_one_in_a_training_step_run_in_a_thread(
    tiny_model: Path, tmp_path: Path
):
    """A real GRPO step, off the main thread, whose completions are forced to the right answer."""
    from datasets import Dataset

    from training.args import parse_args
    from training.model import load_model, load_tokenizer
    from training.reward_guard import ScoreTally
    from training.reward_setup import build_rewards
    from training.trainer import build_trainer

    argv = ["--model", str(tiny_model), "--dataset", "unused.jsonl",
            "--reward_function", "math_equivalence", "--output_dir", str(tmp_path),
            "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "2",
            "--max_completion_length", "1"]  # fmt: skip
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    question = [{"role": "user", "content": "What is 3 + 4?"}]
    dataset = Dataset.from_list([{"prompt": question, "ground_truth": "7"}] * 4)
    rewards, _ = build_rewards(args, ScoreTally())
    trainer = build_trainer(args, load_model(args.model), tokenizer, dataset, rewards, [])
    # The untrained model answers at random: bias its one completion token to "7".
    seven = tokenizer("7", add_special_tokens=False).input_ids
    assert len(seven) == 1
    trainer.generation_config.sequence_bias = {tuple(seven): 100.0}
    errors: list[BaseException] = []

    def train() -> None:
        try:
            trainer.train()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=train)
    worker.start()
    worker.join(300)
    assert not worker.is_alive() and not errors, errors
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] == 1.0
    assert logged["rewards/math_equivalence/mean"] == 1.0
