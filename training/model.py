"""Load the policy model and tokenizer: plain transformers (+ PEFT LoRA) or Unsloth."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.errors import TransientError, UsageError, is_network_timeout, one_line

if TYPE_CHECKING:
    from training.args import ScriptArguments

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def require_unsloth() -> None:
    """Import Unsloth before trl/transformers (it patches them); UsageError when it cannot run."""
    if importlib.util.find_spec("unsloth") is None:
        raise UsageError("--use_unsloth: unsloth is not installed (pip install 'rlfleet[unsloth]')")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--use_unsloth: Unsloth needs a CUDA GPU and none is visible")
    try:
        import unsloth  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - unsloth raises assorted errors on unsupported setups
        raise UsageError(f"--use_unsloth: unsloth cannot be used here: {one_line(exc)}") from exc


def require_vllm() -> None:
    """UsageError unless vllm can be imported, which TRL needs for --use_vllm in either mode."""
    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--use_vllm: vllm is not installed (pip install vllm)")


def _dtype() -> Any:
    import torch

    # bf16 on GPUs; CPUs lack fast bf16 kernels for training, so fp32 there.
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def _loading(what: str, name: str, load: Callable[[str], Any]) -> Any:
    """Run `load(source)`, turning hub and file errors into UsageError / TransientError.

    `source` is `name`, or for a local path the path with `~` expanded: from_pretrained would
    take `~/model` for a hub name.
    """
    local = name.startswith(("/", "./", "../", "~"))
    source = str(Path(name).expanduser()) if local else name
    if local and not Path(source).is_dir():
        raise UsageError(f"cannot load {what}: no such directory {name}")
    try:
        return load(source)
    except (OSError, ValueError) as exc:
        if is_network_timeout(exc):
            raise TransientError(f"downloading {what} {name} failed: {one_line(exc)}") from exc
        raise UsageError(f"cannot load {what} {name}: {one_line(exc)}") from exc


def load_tokenizer(name: str) -> Any:
    """The model's tokenizer; GRPOTrainer gives it the EOS token as pad token if it has none."""
    from transformers import AutoTokenizer

    return _loading("tokenizer", name, AutoTokenizer.from_pretrained)


def load_model(name: str) -> Any:
    """The causal LM in bf16 on GPU, fp32 on CPU; accelerate places it on the devices."""
    from transformers import AutoModelForCausalLM

    return _loading(
        "model", name, lambda source: AutoModelForCausalLM.from_pretrained(source, dtype=_dtype())
    )


def lora_alpha(args: ScriptArguments) -> int:
    """`--lora_alpha`, or twice `--lora_r` when it is 0."""
    return args.lora_alpha or 2 * args.lora_r


def lora_config(args: ScriptArguments) -> Any:
    """A PEFT LoRA config for `--lora_r` > 0, None for a full fine-tune."""
    if args.lora_r == 0:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=lora_alpha(args),
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def load_unsloth_model(args: ScriptArguments) -> tuple[Any, Any]:
    """Model and tokenizer through Unsloth's FastLanguageModel, with LoRA applied by Unsloth."""
    from unsloth import FastLanguageModel

    model, tokenizer = _loading(
        "model",
        args.model,
        lambda source: FastLanguageModel.from_pretrained(
            model_name=source,
            max_seq_length=args.max_completion_length + 1024,
            load_in_4bit=False,
            fast_inference=args.use_vllm,
            max_lora_rank=max(args.lora_r, 1),
            full_finetuning=args.lora_r == 0,
        ),
    )
    if args.lora_r > 0:
        model = FastLanguageModel.get_peft_model(
            model,
            r=args.lora_r,
            lora_alpha=lora_alpha(args),
            target_modules=LORA_TARGETS,
            use_gradient_checkpointing="unsloth",
            random_state=args.seed,
        )
    return model, tokenizer
