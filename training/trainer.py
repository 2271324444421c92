"""Build TRL's GRPOTrainer from the script arguments, and save the final model.

Imported only after Unsloth (when asked for), because importing trl pulls in transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from training.args import ScriptArguments
from training.errors import UsageError, one_line


def node_count() -> int:
    """How many machines this run spans, from the environment torchrun gives each process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError:
        return 1
    return max(world // local, 1) if local > 0 else 1


def build_config(args: ScriptArguments) -> GRPOConfig:
    """GRPOConfig from the script arguments: rlfleet's flags and defaults, then every TRL field
    given on the command line or in the recipe; an impossible combination raises UsageError."""
    on_gpu = torch.cuda.is_available()
    trl = args.trl_group("grpo")
    defaults: dict[str, Any] = {
        "save_strategy": "steps",
        "report_to": "none",
        # Without use_cpu, accelerate puts the processes `accelerate launch --multi_gpu`
        # starts on a machine without CUDA in no process group at all: each would train
        # alone as rank 0. With it they join one gloo group.
        "use_cpu": not on_gpu,
        # Nodes of a multi-node run have disks of their own: each keeps a full checkpoint,
        # so that each can resume (the final model is still saved once, by rank 0).
        "save_on_each_node": node_count() > 1,
        "dataloader_pin_memory": on_gpu,
    }
    if "fp16" not in trl:
        # CPUs have no fast bf16 training path.
        defaults["bf16"] = on_gpu
    if "gradient_checkpointing" not in trl and "activation_checkpointing" not in trl:
        # Checkpointing activations only saves GPU memory. transformers 5 renamed
        # gradient_checkpointing (deprecated) to activation_checkpointing.
        renamed = "activation_checkpointing" in GRPOConfig.__dataclass_fields__
        defaults["activation_checkpointing" if renamed else "gradient_checkpointing"] = on_gpu
    own = {
        "output_dir": args.output_dir,
        "max_steps": args.max_steps,
        "learning_rate": args.learning_rate,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length,
        "temperature": args.temperature,
        "beta": args.beta,
        "seed": args.seed,
        "reward_weights": args.reward_weights,
        "use_vllm": args.use_vllm,
        "vllm_mode": args.vllm_mode,
        "vllm_server_base_url": args.vllm_server_base_url,
        "vllm_server_host": args.vllm_server_host,
        "vllm_server_port": args.vllm_server_port,
        "vllm_group_port": args.vllm_group_port,
        "vllm_server_timeout": args.vllm_server_timeout,
        "logging_steps": args.logging_steps,
        "save_steps": args.save_steps,
        "save_total_limit": args.save_total_limit or None,
    }
    if "num_train_epochs" in trl and "max_steps" not in args.given:
        del own["max_steps"]  # A recipe that counts epochs, as `trl grpo` would run it.
    # The model is loaded by training.model, which applies model_init_kwargs itself.
    trl.pop("model_init_kwargs", None)
    try:
        return GRPOConfig(**{**defaults, **own, **trl})
    except (ValueError, TypeError) as exc:
        raise UsageError(one_line(exc)) from exc


_TRUTHY = {"1", "true", "yes", "on"}


def check_environment(args: ScriptArguments) -> None:
    """UsageError, naming the key and the way out, for what this machine cannot do: bf16 or
    fp16 without a GPU, pushing to an offline hub, a tracker that is not installed. Runs
    before anything is loaded."""
    if not torch.cuda.is_available():
        for key in ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval"):
            if args.trl.get(key):
                raise UsageError(
                    f"{key}: needs a CUDA GPU and none is visible here (set {key} to false or "
                    "leave it out: train-grpo trains in fp32 on a CPU)"
                )
    for key in ("push_to_hub", "hub_model_id"):
        if not args.trl.get(key):
            continue
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUTHY:
            raise UsageError(
                f"{key}: the hub is offline here (HF_HUB_OFFLINE is set); leave push_to_hub and "
                f"hub_model_id out and upload the model from {args.output_dir} afterwards"
            )
        if key == "push_to_hub":
            from huggingface_hub import get_token

            if get_token() is None:
                raise UsageError(
                    "push_to_hub: no hub token here; set HF_TOKEN in the job's environment "
                    "(rlfleet job submit --env HF_TOKEN) or leave push_to_hub out"
                )
    names = args.report_to()
    if names and names != ["all"]:
        from transformers.integrations import get_available_reporting_integrations

        available = set(get_available_reporting_integrations())
        for name in names:
            if name not in available:
                raise UsageError(
                    f"report_to {name}: {name} is not installed here (pip install {name}, or "
                    "report to tensorboard or trackio, which the rlfleet[train] extra installs)"
                )
    if "wandb" in names:
        mode = os.environ.get("WANDB_MODE", "").lower()
        if not os.environ.get("WANDB_API_KEY") and mode not in ("offline", "disabled", "dryrun"):
            raise UsageError(
                "report_to wandb: no WANDB_API_KEY here; set it in the job's environment "
                "(--env WANDB_API_KEY), or WANDB_MODE=offline to log to the output directory"
            )


def build_trainer(
    args: ScriptArguments,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    rewards: Sequence[Callable[..., Any]],
    callbacks: list[Any],
    peft_config: Any = None,
    config: GRPOConfig | None = None,
    eval_dataset: Any = None,
) -> GRPOTrainer:
    """A GRPOTrainer ready to train (with `config`, or the GRPOConfig of `args`)."""
    return GRPOTrainer(
        model=model,
        reward_funcs=list(rewards),  # type: ignore[arg-type]  # TRL also accepts list[float]
        args=config if config is not None else build_config(args),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )


def save_final(trainer: GRPOTrainer, tokenizer: Any, output_dir: str) -> None:
    """Save a model `AutoModelForCausalLM.from_pretrained(output_dir)` loads, with its tokenizer,
    from the first process of the run only.

    A LoRA run also keeps its adapter in `output_dir/adapter`, and saves the merged weights as
    the model, so loading needs neither PEFT nor the base model.
    """
    # Checkpoints go to every node; the model goes once, to rank 0's output_dir.
    trainer.args.save_on_each_node = False
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not hasattr(model, "merge_and_unload"):
        trainer.save_model(output_dir)
        return
    trainer.save_model(str(Path(output_dir) / "adapter"))
    if trainer.accelerator.is_main_process:
        model.merge_and_unload().save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    trainer.accelerator.wait_for_everyone()


def logged_rewards(trainer: GRPOTrainer) -> list[float]:
    """The mean reward at each logging step, oldest first (a resumed run includes earlier ones)."""
    history = trainer.state.log_history
    return [entry["reward"] for entry in history if entry.get("reward") is not None]
