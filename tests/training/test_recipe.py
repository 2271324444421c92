"""A recipe written in `trl grpo --config`'s format trains the tiny model through the real
script, and every value it (or the command line over it) gives is the value the GRPOTrainer
ran with: read back from the checkpoint's training_args.bin and the adapter's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.helpers import ARITHMETIC, train_grpo

RECIPE = """\
# A recipe as `trl grpo --config` reads it (model and dataset paths filled in by the test).
model_name_or_path: {model}
dataset_name: {dataset}
reward_funcs:
  - rewards.keywords.keyword_match
  - think_format_reward
reward_weights: [1.0, 0.5]
keywords: [hello]
max_steps: 3
num_generations: 4
per_device_train_batch_size: 4
max_completion_length: 8
learning_rate: 3.0e-3
lr_scheduler_type: cosine
warmup_steps: 1
gradient_checkpointing: true
loss_type: dr_grpo
epsilon_high: 0.28
scale_rewards: batch
num_iterations: 2
temperature: 0.9
top_p: 0.95
dtype: float32
use_peft: true
lora_r: 4
lora_alpha: 8
lora_target_modules: [q_proj, v_proj]
logging_steps: 1
save_strategy: steps
save_steps: 2
report_to: [tensorboard]
seed: 3
"""

CLI_OVERRIDES = ["--seed", "11", "--top_p", "0.9"]


def write_recipe(path: Path, model: Path) -> Path:
    """The test recipe at `path`, naming `model` and the arithmetic data."""
    path.write_text(RECIPE.format(model=model, dataset=ARITHMETIC))
    return path


@pytest.fixture(scope="module")
def recipe_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of a 3-step run of the recipe."""
    root = tmp_path_factory.mktemp("recipe")
    recipe = write_recipe(root / "recipe.yaml", tiny_model)
    out = root / "out"
    result = train_grpo("--config", str(recipe), "--output_dir", str(out), *CLI_OVERRIDES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("train-grpo: done after 3 steps")
    return out


@pytest.fixture(scope="module")
def ran_with(recipe_run: Path) -> Any:
    """The TrainingArguments the trainer saved with its checkpoint."""
    return torch.load(recipe_run / "checkpoint-2" / "training_args.bin", weights_only=False)


def _value(value: Any) -> Any:
    return getattr(value, "value", value)  # enums (lr_scheduler_type, save_strategy)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("loss_type", "dr_grpo"),
        ("lr_scheduler_type", "cosine"),
        ("warmup_steps", 1),
        ("gradient_checkpointing", True),
        ("epsilon_high", 0.28),
        ("scale_rewards", "batch"),
        ("num_iterations", 2),
        ("temperature", 0.9),
        ("top_p", 0.9),  # the command line over the recipe's 0.95
        ("seed", 11),  # the command line over the recipe's 3
        ("learning_rate", 3e-3),
        ("logging_steps", 1),
        ("save_strategy", "steps"),
        ("save_steps", 2),
        ("max_steps", 3),
        ("reward_weights", [1.0, 0.5]),
        ("report_to", ["tensorboard"]),
    ],
)
def test_each_value_reaches_the_trainer(ran_with: Any, field: str, expected: Any):
    assert _value(getattr(ran_with, field)) == expected


@pytest.mark.slow
def test_the_lora_settings_and_dtype_reach_the_model(recipe_run: Path):
    adapter = json.loads((recipe_run / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
    assert set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    config = json.loads((recipe_run / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"


@pytest.mark.slow
def test_the_run_leaves_model_progress_and_tensorboard_events(recipe_run: Path):
    assert (recipe_run / "model.safetensors").is_file()
    progress = json.loads((recipe_run / "progress.json").read_text())
    assert progress["status"] == "finished" and progress["step"] == 3
    events = list((recipe_run / "runs").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


@pytest.mark.slow
def test_trackio_logs_land_in_the_output_dir(tiny_model: Path, tmp_path: Path):
    from tests.training.helpers import tiny_run_args

    out = tmp_path / "out"
    home = tmp_path / "home"  # where trackio would write by default (~/.cache/huggingface)
    argv = tiny_run_args(tiny_model, out, "--max_steps", "1", "--report_to", "trackio",
                         "--project", "recipe-test")  # fmt: skip
    result = train_grpo(*argv, env={"HOME": str(home), "HF_HOME": str(home / "hf")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "trackio" / "recipe-test.db").is_file()
    assert not (home / "hf" / "trackio").exists()
