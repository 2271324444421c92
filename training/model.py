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


def load_model(name: str, **kwargs: Any) -> Any:
    """The causal LM in bf16 on GPU, fp32 on CPU (unless `kwargs` give a dtype); accelerate
    places it on the devices. `kwargs` go to `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("dtype", _dtype())
    return _loading(
        "model", name, lambda source: AutoModelForCausalLM.from_pretrained(source, **kwargs)
    )


def model_init_kwargs(args: ScriptArguments, model_args: Any) -> dict[str, Any]:
    """What `from_pretrained` is given, as `trl grpo` gives it: ModelConfig's dtype,
    attn_implementation, model_revision and quantization, GRPOConfig's trust_remote_code,
    then GRPOConfig's model_init_kwargs; only what was given (rlfleet's dtype otherwise)."""
    from trl import get_quantization_config

    kwargs: dict[str, Any] = {}
    model = args.trl_group("model")
    if "dtype" in model and model_args.dtype not in (None, "auto"):
        import torch

        kwargs["dtype"] = getattr(torch, model_args.dtype)
    elif "dtype" in model:
        kwargs["dtype"] = "auto"
    for key, name in (("attn_implementation",) * 2, ("revision", "model_revision")):
        if name in model:
            kwargs[key] = getattr(model_args, name)
    if "trust_remote_code" in args.trl:
        kwargs["trust_remote_code"] = args.trl["trust_remote_code"]
    quantization = get_quantization_config(model_args)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    extra = args.trl.get("model_init_kwargs")
    if isinstance(extra, str):
        import json

        try:
            extra = json.loads(extra)
        except ValueError:
            raise UsageError(f"model_init_kwargs: not a JSON object: {extra!r}") from None
    if extra is not None and not isinstance(extra, dict):
        raise UsageError(f"model_init_kwargs: expected a mapping, got {extra!r}")
    kwargs.update(extra or {})
    return kwargs


def lora_alpha(args: ScriptArguments) -> int:
    """`--lora_alpha`, or twice `--lora_r` when it is 0."""
    return args.lora_alpha or 2 * args.lora_r


def model_config(args: ScriptArguments) -> Any:
    """TRL's ModelConfig from the arguments; a bad combination raises UsageError.

    LoRA comes two ways. TRL's: `use_peft` with `lora_r`, `lora_alpha`, `lora_target_modules`…
    at TRL's defaults where not given, as `trl grpo` runs it. rlfleet's: `--lora_r N` alone,
    with alpha twice the rank (or `--lora_alpha`) on all linear layers."""
    from trl import ModelConfig

    kwargs = args.trl_group("model")
    kwargs["model_name_or_path"] = args.model
    if args.lora_r > 0 or "lora_r" in args.given:
        kwargs["lora_r"] = args.lora_r
    if args.lora_alpha > 0:
        kwargs["lora_alpha"] = args.lora_alpha
    if "use_peft" not in kwargs:
        kwargs["use_peft"] = args.lora_r > 0
        if args.lora_r > 0:
            kwargs.setdefault("lora_alpha", lora_alpha(args))
            kwargs.setdefault("lora_target_modules", ["all-linear"])
    try:
        return ModelConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise UsageError(one_line(exc)) from exc


def lora_config(args: ScriptArguments, model_args: Any = None) -> Any:
    """A PEFT LoRA config (TRL's get_peft_config of the ModelConfig), None for a full
    fine-tune."""
    from trl import get_peft_config

    try:
        return get_peft_config(model_args if model_args is not None else model_config(args))
    except (ValueError, TypeError) as exc:
        raise UsageError(one_line(exc)) from exc


def load_unsloth_model(args: ScriptArguments) -> tuple[Any, Any]:
    """Model and tokenizer through Unsloth's FastLanguageModel, with LoRA applied by Unsloth
    (rank, alpha and target modules as the LoRA config of the arguments gives them)."""
    from unsloth import FastLanguageModel

    peft = lora_config(args)
    rank = peft.r if peft is not None else 0

    model, tokenizer = _loading(
        "model",
        args.model,
        lambda source: FastLanguageModel.from_pretrained(
            model_name=source,
            max_seq_length=args.max_completion_length + 1024,
            load_in_4bit=False,
            fast_inference=args.use_vllm,
            max_lora_rank=max(rank, 1),
            full_finetuning=rank == 0,
        ),
    )
    if peft is not None:
        targets = peft.target_modules
        model = FastLanguageModel.get_peft_model(
            model,
            r=rank,
            lora_alpha=peft.lora_alpha,
            target_modules=LORA_TARGETS if targets in (None, "all-linear") else list(targets),
            use_gradient_checkpointing="unsloth",
            random_state=args.seed,
        )
    return model, tokenizer
