"""train_grpo.py's own flags: `ScriptArguments`, a dataclass with help on every field (the
flag names are its field names), and TRL's names for the ones TRL has too (`ALIASES`).
`training.args` builds the command line from it; `trlspec.recipe` checks a recipe's keys
against it, for the training and for the scheduler at submit time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rewards import BUILTIN_REWARDS
from trlspec.schema import fields_by_name

DEFAULT_MAX_UNSCORED_STEPS = 3
"""Consecutive steps in which no completion got a score before training stops with exit 64."""


@dataclass
class ScriptArguments:
    """Everything train_grpo.py can be told; field names are the flag names."""

    model: str = field(
        default="",
        metadata={
            "help": "Model to train: a hub name (Qwen/Qwen2.5-0.5B-Instruct) or a local directory "
            "(TRL's model_name_or_path)."
        },
    )
    dataset: str = field(
        default="",
        metadata={
            "help": "Training data: a local .json/.jsonl/.parquet/.csv file or a hub dataset name "
            "(TRL's dataset_name; or a mixture in `datasets`). Needs a 'prompt' or 'question' "
            "column; an 'answer' column becomes 'ground_truth'."
        },
    )
    reward_function: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward function, repeatable (or comma-separated): a built-in name "
            f"({', '.join(BUILTIN_REWARDS)}), module:function or a dotted path importable from "
            "the working directory or PYTHONPATH, or a TRL reward (accuracy_reward, "
            "think_format_reward, ...; TRL's reward_funcs).",
            "metavar": "NAME",
        },
    )
    dataset_split: str = field(
        default="train", metadata={"help": "Dataset split to train on (TRL's dataset_train_split)."}
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "Configuration of a hub dataset with several ('main' for openai/gsm8k).",
            "metavar": "NAME",
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function, in the same order (default: all 1.0).",
            "metavar": "WEIGHT",
        },
    )
    keywords: list[str] | None = field(
        default=None,
        metadata={
            "help": "Keywords for keyword_match (space- or comma-separated); without it "
            "keyword_match "
            "reads a 'keywords' column.",
            "metavar": "WORD",
        },
    )
    preprocess: str = field(
        default="generic",
        metadata={
            "help": "Prompt construction: 'generic' uses the question as is; 'deepseek' adds "
            "the R1 "
            "system prompt asking for <think>...</think><answer>...</answer>.",
            "choices": ("generic", "deepseek"),
        },
    )
    output_dir: str = field(
        default="grpo-output",
        metadata={"help": "Where checkpoints, progress.json and the final model are written."},
    )
    max_steps: int = field(
        default=500, metadata={"help": "Number of optimizer steps to train for."}
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    num_generations: int = field(
        default=8, metadata={"help": "Completions sampled per prompt (the GRPO group size, >= 2)."}
    )
    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "help": "Completions per device per step; times the number of devices it must be a "
            "multiple of --num_generations."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches accumulated into one optimizer step."}
    )
    max_completion_length: int = field(
        default=256, metadata={"help": "Maximum number of tokens generated per completion."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature for generation."}
    )
    beta: float = field(
        default=0.0, metadata={"help": "KL penalty coefficient; 0 skips the reference model."}
    )
    lora_r: int = field(
        default=0, metadata={"help": "LoRA rank; 0 trains all the weights (full fine-tune)."}
    )
    lora_alpha: int = field(default=0, metadata={"help": "LoRA alpha; 0 means twice --lora_r."})
    use_unsloth: bool = field(
        default=False,
        metadata={
            "help": "Load and train the model with Unsloth (needs a CUDA GPU and unsloth "
            "installed)."
        },
    )
    use_vllm: bool = field(
        default=False, metadata={"help": "Generate completions with vLLM (passed through to TRL)."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "With --use_vllm: 'colocate' runs vLLM in the training process, 'server' talks "
            "to a running `trl vllm-serve`.",
            "choices": ("colocate", "server"),
        },
    )
    vllm_server_host: str = field(
        default="0.0.0.0",
        metadata={
            "help": "With --vllm_mode server: host name or address of the `trl vllm-serve` server.",
            "metavar": "HOST",
        },
    )
    vllm_server_port: int = field(
        default=8000,
        metadata={"help": "With --vllm_mode server: the HTTP port of the vLLM server."},
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={
            "help": "With --vllm_mode server: the port of the NCCL group that sends the trained "
            "weights to the vLLM server."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "With --vllm_mode server: the server's base URL (http://host:port); replaces "
            "--vllm_server_host and --vllm_server_port.",
            "metavar": "URL",
        },
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "With --vllm_mode server: seconds to wait for the server to be up."},
    )
    seed: int = field(
        default=42, metadata={"help": "Random seed for sampling, shuffling and init."}
    )
    logging_steps: int = field(
        default=1, metadata={"help": "Log metrics and rewrite progress.json every N steps."}
    )
    save_steps: int = field(default=100, metadata={"help": "Save a checkpoint every N steps."})
    save_total_limit: int = field(
        default=2, metadata={"help": "Keep at most this many checkpoints (0 keeps all)."}
    )
    max_unscored_steps: int = field(
        default=DEFAULT_MAX_UNSCORED_STEPS,
        metadata={
            "help": "Stop with exit 64 after this many steps in a row in which no completion got "
            "a score (every reward None or NaN); 0 never stops."
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "Resume training: 'auto' picks the newest checkpoint in --output_dir (starting "
            "fresh when there is none), or give a checkpoint directory (TRL's "
            "resume_from_checkpoint; true there means auto)."
        },
    )
    config: str | None = field(
        default=None,
        metadata={
            "help": "A recipe: a YAML file in `trl grpo --config`'s format (keys are the names of "
            "these flags and of TRL's fields; an `env` mapping sets variables). Flags given on "
            "the command line override the file.",
            "metavar": "RECIPE.yaml",
        },
    )
    trl: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})
    """The TRL fields given (on the command line or in the recipe) that are not fields here."""
    given: frozenset[str] = field(default_factory=frozenset, metadata={"cli": False})
    """The names of every field given on the command line or in the recipe."""
    env: dict[str, str] = field(default_factory=dict, metadata={"cli": False})
    """The recipe's `env` mapping: variables set before anything is loaded."""

    def report_to(self) -> list[str]:
        """The trackers `report_to` names (none when it was not given)."""
        value = self.trl.get("report_to")
        names = [value] if isinstance(value, str) else list(value or [])
        return [str(name) for name in names if name not in (None, "none")]

    def trl_group(self, group: str) -> dict[str, Any]:
        """The TRL fields of class `group` ('grpo', 'model', 'mixture' or 'script', see
        `trlspec.schema.GROUPS`) given beyond rlfleet's own flags, by name."""
        fields = fields_by_name()
        return {k: v for k, v in self.trl.items() if fields.get(k, {}).get("group") == group}


ALIASES: dict[str, str] = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "reward_funcs": "reward_function",
    "resume_from_checkpoint": "resume",
}
"""TRL's names for things rlfleet has a flag of its own for: both spellings are accepted."""


def own_fields() -> dict[str, dataclasses.Field[Any]]:
    """train_grpo.py's own flags (the fields of `ScriptArguments` that are flags), by name,
    in the order `--help` lists them."""
    return {f.name: f for f in dataclasses.fields(ScriptArguments) if f.metadata.get("cli", 1)}


OWN_FIELDS = tuple(own_fields())
"""The names of train_grpo.py's own flags."""
