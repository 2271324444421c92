"""Helpers for the training tests: run the real script as a subprocess, fast tiny-run arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = REPO / "training" / "data" / "arithmetic.jsonl"


def _env(env: dict[str, str] | None) -> dict[str, str]:
    # One torch thread: the tiny model's matrices are too small to gain from more, and on a
    # busy 2-core machine extra threads only contend (measured: half the CPU time, 2x faster).
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    full_env = {**os.environ, **offline, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return full_env


def train_grpo(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run `python -m training.train_grpo ARGS` the way users and the scheduler do."""
    return subprocess.run(
        [sys.executable, "-m", "training.train_grpo", *args],
        cwd=cwd,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_train_grpo(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start `python -m training.train_grpo ARGS` in the background, its output in pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", "training.train_grpo", *args],
        cwd=cwd,
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def tiny_run_args(model: Path, output_dir: Path, *extra: str) -> list[str]:
    """Arguments for a fast CPU run of the tiny model on the arithmetic data."""
    return [
        "--model", str(model),
        "--dataset", str(ARITHMETIC),
        "--reward_function", "keyword_match",
        "--keywords", "hello",
        "--output_dir", str(output_dir),
        "--num_generations", "4",
        "--per_device_train_batch_size", "4",
        "--max_completion_length", "8",
        "--learning_rate", "3e-3",
        *extra,
    ]  # fmt: skip
