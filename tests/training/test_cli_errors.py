"""Each kind of bad input makes the real script exit 64 with one clear line and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.training.helpers import ARITHMETIC, REPO, train_grpo


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    (root / "user_rewards.py").write_text(
        "def ok(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n"
        "THRESHOLD = 0.5\n"
    )
    (root / "broken.jsonl").write_text('{"question": "unterminated\n')
    (root / "no_prompt.jsonl").write_text(json.dumps({"text": "hi", "answer": "1"}) + "\n")
    (root / "no_answer.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    return root


def _case(*args: str) -> list[str]:
    return list(args)


# (arguments after --model, expected message); the model is the tiny one unless given.
CASES = [
    (_case("--reward_function", "nonsense"), "unknown reward function 'nonsense'"),
    (_case("--reward_function", "missing_mod_xyz:f"), "no module named 'missing_mod_xyz'"),
    (_case("--reward_function", "user_rewards:nope"), "has no attribute 'nope'"),
    (_case("--reward_function", "user_rewards:THRESHOLD"), "not callable"),
    (
        _case("--reward_function", "correctness", "xml_count", "--reward_weights", "1"),
        "has 1 values",
    ),
    (_case("--dataset", "{inputs}/missing.jsonl"), "dataset file not found"),
    (_case("--dataset", "{inputs}/broken.jsonl"), "cannot read dataset"),
    (_case("--dataset", "no-such-org/no-such-dataset"), "cannot read dataset"),
    (_case("--dataset", "{inputs}/no_prompt.jsonl"), "no 'prompt' or 'question' column"),
    (_case("--dataset", "{inputs}/no_answer.jsonl"), "correctness needs a 'ground_truth' column"),
    (_case("--reward_function", "keyword_match"), "keyword_match needs a 'keywords' column"),
    (_case("--model", "{inputs}/no-model-here"), "cannot load tokenizer: no such directory"),
    (_case("--resume", "{inputs}"), "not a checkpoint directory"),
    (  # Found only once the model is loaded: its "Loading weights" bar must not show.
        _case("--num_generations", "2", "--per_device_train_batch_size", "3"),
        "must be divisible by num_generations",
    ),
]


@pytest.mark.parametrize(("extra", "message"), CASES, ids=[c[1][:40] for c in CASES])
@pytest.mark.slow
def test_bad_input_exits_64_with_one_line(
    extra: list[str], message: str, inputs: Path, tiny_model: Path, tmp_path: Path
):
    defaults = {"--model": str(tiny_model), "--dataset": str(ARITHMETIC)}
    given = [arg.format(inputs=inputs) for arg in extra]
    base = [x for flag, value in defaults.items() if flag not in given for x in (flag, value)]
    if "--reward_function" not in given:
        base += ["--reward_function", "correctness"]
    result = train_grpo(*base, *given, "--output_dir", str(tmp_path / "out"), cwd=inputs)
    assert result.returncode == 64, result.stderr[-2000:]
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert message in err
    assert err.startswith("train-grpo: error:")


def test_use_unsloth_where_it_cannot_run_says_why(tmp_path: Path, tiny_model: Path):
    import importlib.util

    import torch

    installed = importlib.util.find_spec("unsloth") is not None
    if installed and torch.cuda.is_available():
        pytest.skip("Unsloth can run here: nothing to refuse")
    if installed:
        why = "Unsloth needs a CUDA GPU and none is visible"
    else:
        why = "unsloth is not installed (pip install 'rlfleet[unsloth]')"
    result = train_grpo(
        "--model", str(tiny_model), "--dataset", str(ARITHMETIC),
        "--reward_function", "correctness", "--use_unsloth", "--output_dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 64
    assert result.stderr.strip() == f"train-grpo: error: --use_unsloth: {why}"


@pytest.mark.parametrize(
    "command",
    [
        ["training/train_grpo.py", "--help"],
        ["-m", "training.train_grpo", "--help"],
    ],
)
def test_help_runs_as_file_and_as_module(command: list[str]):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "--reward_function NAME" in result.stdout
    assert "Exit codes: 0 done, 64" in result.stdout
