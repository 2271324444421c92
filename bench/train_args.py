"""Benchmark: `train-grpo --help` time, and a GRPO run through train_grpo.py against the same
run on plain TRL (GRPOConfig + GRPOTrainer, nothing of rlfleet's around it).

Both runs train the tiny model (training/tiny_model.py) on the arithmetic data with the same
configuration: 100 steps, 4 completions of 8 tokens per prompt, keyword_match('hello') as the
reward, logging every step, no checkpoints, on the CPU with one thread. Each run is a fresh
process, timed from start to exit (imports, loading and saving included).

    .venv/bin/python bench/train_args.py [--steps 100] [--help-runs 5] [--repeats 2]

Each run is repeated (alternating the two sides, so that a busy moment of the machine does
not land on one side only) and the fastest of each side is kept; the ratio compares CPU
seconds (user + system of the run's process), which a shared machine disturbs far less than
wall time (printed beside it).
Last line: `train_args: help_s=<median> rlfleet_s=<…> trl_s=<…> ratio=<rlfleet/trl>`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "training" / "data" / "arithmetic.jsonl"
SHARED = {
    "num_generations": 4,
    "per_device_train_batch_size": 4,
    "max_completion_length": 8,
    "learning_rate": 3e-3,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 42,
    "beta": 0.0,
    "temperature": 1.0,
}

# The plain-TRL run: what a TRL user would write for the same configuration (GRPOConfig
# equal to the one train_grpo.py builds, checked field by field when this was written).
PLAIN = """
import json, sys
from functools import partial
from trl import GRPOConfig, GRPOTrainer
from transformers import AutoTokenizer
from rewards.keywords import keyword_match
from training.data import load_raw_dataset, preprocess

model_dir, out, steps, shared = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
data = preprocess(load_raw_dataset(sys.argv[5], "train"), "generic", conversational=True)
config = GRPOConfig(output_dir=out, max_steps=steps, use_cpu=True, bf16=False,
                    gradient_checkpointing=False, dataloader_pin_memory=False,
                    report_to="none", **shared)
trainer = GRPOTrainer(
    model=model_dir,  # loaded by TRL, in float32 (its default), as `trl grpo` does
    reward_funcs=[partial(keyword_match, fixed_keywords=["hello"])],
    args=config, train_dataset=data, processing_class=tokenizer,
)
trainer.train()
trainer.save_model(out)
"""


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str]) -> float:
    """Wall seconds of one run (and its CPU seconds in `_timed.cpu`)."""
    started, cpu = time.monotonic(), _cpu()
    result = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True)
    elapsed = time.monotonic() - started
    _timed.cpu = _cpu() - cpu  # type: ignore[attr-defined]
    if result.returncode != 0:
        sys.exit(f"{argv[:4]} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return elapsed


def help_seconds(runs: int) -> float:
    """Median wall time of `python -m training.train_grpo --help`."""
    argv = [sys.executable, "-m", "training.train_grpo", "--help"]
    return statistics.median(_timed(argv) for _ in range(runs))


def rlfleet_seconds(model: Path, out: Path, steps: int) -> float:
    argv = [sys.executable, "-m", "training.train_grpo", "--model", str(model),
            "--dataset", str(DATA), "--reward_function", "keyword_match", "--keywords", "hello",
            "--output_dir", str(out), "--max_steps", str(steps)]  # fmt: skip
    for name, value in SHARED.items():
        argv += [f"--{name}", str(value)]
    return _timed(argv)


def trl_seconds(model: Path, out: Path, steps: int) -> float:
    import json

    argv = [sys.executable, "-c", PLAIN, str(model), str(out), str(steps), json.dumps(SHARED),
            str(DATA)]  # fmt: skip
    return _timed(argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--help-runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from training.tiny_model import save_tiny_model

    help_s = help_seconds(args.help_runs)
    print(f"train-grpo --help: {help_s:.3f} s (median of {args.help_runs})", flush=True)
    runs: dict[str, list[tuple[float, float]]] = {"trl": [], "rlfleet": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "tiny")
        for i in range(args.repeats):
            for side, timed, title in (("trl", trl_seconds, "plain TRL"),
                                       ("rlfleet", rlfleet_seconds, "train_grpo.py")):  # fmt: skip
                wall = timed(model, Path(tmp) / f"{side}-{i}", args.steps)
                runs[side].append((wall, _timed.cpu))  # type: ignore[attr-defined]
                print(
                    f"{title}, {args.steps} steps: {wall:.1f} s wall, {_timed.cpu:.1f} s CPU",
                    flush=True,
                )  # type: ignore[attr-defined]
    # The CPU time of the fastest run of each side: on a shared machine the wall time
    # mostly measures the neighbours.
    trl_wall, trl_s = min(runs["trl"], key=lambda r: r[1])
    rlfleet_wall, rlfleet_s = min(runs["rlfleet"], key=lambda r: r[1])
    print(
        f"train_args: help_s={help_s:.3f} rlfleet_s={rlfleet_s:.1f} trl_s={trl_s:.1f} "
        f"ratio={rlfleet_s / trl_s:.2f} (CPU seconds; wall {rlfleet_wall:.1f} vs {trl_wall:.1f})"
    )


if __name__ == "__main__":
    main()
