"""The command line of train_grpo.py: a dataclass with help on every field, parsed by argparse.

argparse rather than transformers' HfArgumentParser keeps `--help` and argument errors fast,
and keeps transformers from being imported before Unsloth, which must come first.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, NoReturn

from rewards import BUILTIN_REWARDS
from training.errors import EXIT_USAGE
from training.reward_guard import DEFAULT_MAX_UNSCORED_STEPS


@dataclass
class ScriptArguments:
    """Everything train_grpo.py can be told; field names are the flag names."""

    model: str = field(
        metadata={
            "help": "Model to train: a hub name (Qwen/Qwen2.5-0.5B-Instruct) or a local directory."
        }
    )
    dataset: str = field(
        metadata={
            "help": "Training data: a local .json/.jsonl/.parquet/.csv file or a hub dataset name. "
            "Needs a 'prompt' or 'question' column; an 'answer' column becomes 'ground_truth'."
        }
    )
    reward_function: list[str] = field(
        metadata={
            "help": "Reward function, repeatable (or comma-separated): a built-in name "
            f"({', '.join(BUILTIN_REWARDS)}) or module:function importable from the working "
            "directory or PYTHONPATH.",
            "metavar": "NAME",
        }
    )
    dataset_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
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
            "fresh when there is none), or give a checkpoint directory."
        },
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # The scheduler reads exit codes: bad arguments are permanent failures (64), not
        # argparse's usual 2.
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _str2bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_argument(parser: argparse.ArgumentParser, f: dataclasses.Field[Any]) -> None:
    kwargs: dict[str, Any] = {"help": f.metadata["help"], "dest": f.name}
    for key in ("choices", "metavar"):
        if key in f.metadata:
            kwargs[key] = f.metadata[key]
    kind = str(f.type)
    if f.default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = f.default
        if f.default is not None and f.default is not False:
            kwargs["help"] += " (default: %(default)s)"
    if kind == "bool":
        kwargs.update(nargs="?", const=True, type=_str2bool, metavar="BOOL")
    elif kind.startswith("list["):
        kwargs.update(action="extend", nargs="+", type=str)
    elif "choices" not in kwargs and f.name != "resume" and kind.startswith("str"):
        kwargs.setdefault("metavar", f.name.split("_")[-1].upper())
    elif kind.startswith(("int", "float")):
        kwargs["type"] = int if kind.startswith("int") else float
    parser.add_argument(f"--{f.name}", **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one `--flag` per ScriptArguments field."""
    parser = _Parser(
        prog="train-grpo",
        usage="%(prog)s --model MODEL --dataset DATASET --reward_function NAME [options]",
        description="Train a causal LM with GRPO (TRL) on a prompt dataset and reward functions.",
        epilog="Exit codes: 0 done, 64 bad arguments or input (a reward function that raises or "
        "returns no valid scores included), 75 transient failure (retry), 143 stopped by SIGTERM "
        "after saving a checkpoint of the current step (--resume auto continues from it).",
    )
    for f in dataclasses.fields(ScriptArguments):
        _add_argument(parser, f)
    return parser


def _split_commas(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> ScriptArguments:
    """Parse and check the command line; a bad value exits 64 with one line on stderr."""
    parser = build_parser()
    namespace = vars(parser.parse_args(argv))
    namespace["reward_function"] = _split_commas(namespace["reward_function"])
    namespace["keywords"] = _split_commas(namespace["keywords"])
    weights = _split_commas(namespace["reward_weights"])
    try:
        namespace["reward_weights"] = None if weights is None else [float(w) for w in weights]
    except ValueError:
        parser.error(f"--reward_weights: expected numbers, got {' '.join(weights or [])}")
    args = ScriptArguments(**namespace)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    return args


# Integer flags and the least value each accepts; anything smaller is refused before any
# loading, rather than failing later inside TRL with a traceback.
_INTEGER_MINIMUMS: tuple[tuple[str, int], ...] = (
    ("max_steps", 1),
    ("num_generations", 2),
    ("per_device_train_batch_size", 1),
    ("gradient_accumulation_steps", 1),
    ("max_completion_length", 1),
    ("lora_r", 0),
    ("lora_alpha", 0),
    ("logging_steps", 1),
    ("save_steps", 1),
    ("save_total_limit", 0),
    ("max_unscored_steps", 0),
)


def check_args(args: ScriptArguments) -> str | None:
    """Return what is wrong with a combination of arguments, or None when they make sense."""
    if not args.reward_function:
        return "--reward_function: give at least one reward function"
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward_function):
        return (
            f"--reward_weights has {len(args.reward_weights)} values for "
            f"{len(args.reward_function)} reward functions"
        )
    for name, minimum in _INTEGER_MINIMUMS:
        if getattr(args, name) < minimum:
            return f"--{name} must be at least {minimum}"
    return check_vllm_args(args)


# A host name or an IPv4/IPv6 address; nothing that could add a path, user or query to a URL.
# \Z, not $: `$` also matches before a final newline.
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+\Z|^[0-9A-Fa-f:.]+\Z")


def check_vllm_args(args: ScriptArguments) -> str | None:
    """Return what is wrong with the vLLM server flags, or None."""
    for name in ("vllm_server_port", "vllm_group_port"):
        if not 1 <= getattr(args, name) <= 65535:
            return f"--{name} must be a port number (1 to 65535)"
    if not args.vllm_server_timeout > 0:
        return "--vllm_server_timeout must be more than 0"
    if len(args.vllm_server_host) > 253 or not _HOST.match(args.vllm_server_host):
        return f"--vllm_server_host: not a host name or address: {args.vllm_server_host!r}"
    url = args.vllm_server_base_url
    if url is not None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
            return f"--vllm_server_base_url: expected http://HOST:PORT, got {url!r}"
    return None
