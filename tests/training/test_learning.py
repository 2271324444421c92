"""GRPO really learns: the tiny random model learns to say a keyword within 100 CPU steps."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.training.helpers import ARITHMETIC
from training.args import parse_args
from training.train_grpo import run

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The tiny model trains faster on one thread, and far faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_torch_thread")
def test_keyword_match_reward_rises_to_at_least_0_9(tiny_model: Path, tmp_path: Path):
    args = parse_args(
        [
            "--model", str(tiny_model),
            "--dataset", str(ARITHMETIC),
            "--reward_function", "keyword_match",
            "--keywords", "hello",
            "--output_dir", str(tmp_path),
            "--max_steps", "100",
            "--learning_rate", "3e-3",
            "--num_generations", "8",
            "--per_device_train_batch_size", "8",
            "--max_completion_length", "16",
            "--save_steps", "1000",
            # Each logged reward averages 5 steps (40 samples): one unlucky sample at the
            # last step must not decide the test.
            "--logging_steps", "5",
            "--seed", "0",
        ]
    )  # fmt: skip
    started = time.monotonic()
    result = run(args)
    elapsed = time.monotonic() - started

    first, last = result.rewards[0], result.rewards[-1]
    print(f"keyword_match mean reward: first {first:.3f}, last {last:.3f}, "
          f"{len(result.rewards)} logging steps, {elapsed:.1f}s")  # fmt: skip
    assert len(result.rewards) == 20
    assert first < 0.5, "the untrained model should rarely say the keyword"
    assert last >= 0.9
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["rewards"]["keyword_match"] == last
