"""Which combinations of train_grpo.py's arguments cannot work (`check_args`): each is
refused with one line before anything is loaded, rather than failing later inside TRL with
a traceback. `training.args.parse_args` asks after parsing."""

from __future__ import annotations

import re
import urllib.parse

from trlspec.flags import ScriptArguments

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
    if not args.model:
        return "the model is required: give --model (TRL's model_name_or_path)"
    if not args.dataset and not args.trl.get("datasets"):
        return "the dataset is required: give --dataset (TRL's dataset_name, or datasets)"
    if not args.reward_function:
        return "--reward_function: give at least one reward function (TRL's reward_funcs)"
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward_function):
        return (
            f"--reward_weights has {len(args.reward_weights)} values for "
            f"{len(args.reward_function)} reward functions"
        )
    for name, minimum in _INTEGER_MINIMUMS:
        value = getattr(args, name)
        if name == "max_steps" and value == -1 and "num_train_epochs" in args.given:
            continue  # TRL's way of training for num_train_epochs instead.
        if value < minimum:
            return f"--{name} must be at least {minimum}"
    if args.lora_r == 0 and "lora_r" in args.given and args.trl.get("use_peft"):
        return "use_peft needs a LoRA rank: --lora_r must be at least 1"
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
