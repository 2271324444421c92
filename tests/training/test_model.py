"""Loading the model and tokenizer: local paths, the LoRA config, the pad token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

from training.args import ScriptArguments
from training.errors import UsageError
from training.model import load_model, load_tokenizer, lora_alpha, lora_config


def _args(**overrides: Any) -> ScriptArguments:
    return ScriptArguments(model="m", dataset="d", reward_function=["a"], **overrides)


def test_a_home_relative_model_path_is_expanded(tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tiny_model.parent))
    name = f"~/{tiny_model.name}"
    assert load_tokenizer(name).eos_token is not None
    assert load_model(name).config.model_type == "qwen2"


def test_a_missing_local_directory_is_a_usage_error(tmp_path: Path):
    with pytest.raises(UsageError, match="no such directory"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_lora_alpha_defaults_to_twice_the_rank():
    assert lora_alpha(_args(lora_r=4)) == 8
    assert lora_alpha(_args(lora_r=4, lora_alpha=3)) == 3
    assert lora_config(_args(lora_r=4)).lora_alpha == 8
    assert lora_config(_args()) is None


def test_the_trainer_gives_a_tokenizer_without_pad_token_one(tiny_model: Path, tmp_path: Path):
    # load_tokenizer leaves the pad token alone because GRPOTrainer sets it; this holds it to it.
    from training.trainer import build_trainer

    tokenizer = load_tokenizer(str(tiny_model))
    tokenizer.pad_token = None
    args = _args(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2)
    data = Dataset.from_list([{"prompt": "Say hi"}] * 4)
    reward = [lambda prompts, completions, **kwargs: [0.0] * len(completions)]
    build_trainer(args, load_model(str(tiny_model)), tokenizer, data, reward, [])
    assert tokenizer.pad_token == tokenizer.eos_token


def test_reward_weights_reach_the_trainer(tiny_model: Path, tmp_path: Path):
    from training.args import parse_args
    from training.trainer import build_config, build_trainer

    argv = ["--model", str(tiny_model), "--dataset", "d.jsonl", "--output_dir", str(tmp_path)]
    argv += ["--reward_function", "a", "b", "--reward_weights", "1", "0.5"]
    argv += ["--num_generations", "2", "--per_device_train_batch_size", "2"]
    args = parse_args(argv)
    assert build_config(args).reward_weights == [1.0, 0.5]
    data = Dataset.from_list([{"prompt": "Say hi"}] * 4)
    reward = [lambda prompts, completions, **kwargs: [0.0] * len(completions)] * 2
    trainer = build_trainer(
        args, load_model(str(tiny_model)), load_tokenizer(str(tiny_model)), data, reward, []
    )
    assert trainer.reward_weights.tolist() == [1.0, 0.5]
