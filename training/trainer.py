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
    """GRPOConfig from the script arguments; an impossible combination raises UsageError."""
    on_gpu = torch.cuda.is_available()
    # CPUs have no fast bf16 training path, and checkpointing activations only saves GPU memory.
    # transformers 5 renamed gradient_checkpointing (deprecated) to activation_checkpointing.
    renamed = "activation_checkpointing" in GRPOConfig.__dataclass_fields__
    name = "activation_checkpointing" if renamed else "gradient_checkpointing"
    checkpointing: dict[str, Any] = {name: on_gpu}
    try:
        return GRPOConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            learning_rate=args.learning_rate,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            beta=args.beta,
            seed=args.seed,
            reward_weights=args.reward_weights,
            use_vllm=args.use_vllm,
            vllm_mode=args.vllm_mode,
            vllm_server_base_url=args.vllm_server_base_url,
            vllm_server_host=args.vllm_server_host,
            vllm_server_port=args.vllm_server_port,
            vllm_group_port=args.vllm_group_port,
            vllm_server_timeout=args.vllm_server_timeout,
            logging_steps=args.logging_steps,
            save_strategy="steps",
            save_steps=args.save_steps,
            save_total_limit=args.save_total_limit or None,
            # Without use_cpu, accelerate puts the processes `accelerate launch --multi_gpu`
            # starts on a machine without CUDA in no process group at all: each would train
            # alone as rank 0. With it they join one gloo group.
            use_cpu=not on_gpu,
            # Nodes of a multi-node run have disks of their own: each keeps a full checkpoint,
            # so that each can resume (the final model is still saved once, by rank 0).
            save_on_each_node=node_count() > 1,
            bf16=on_gpu,
            dataloader_pin_memory=on_gpu,
            report_to="none",
            **checkpointing,
        )
    except ValueError as exc:
        raise UsageError(one_line(exc)) from exc


def build_trainer(
    args: ScriptArguments,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    rewards: Sequence[Callable[..., Any]],
    callbacks: list[Any],
    peft_config: Any = None,
) -> GRPOTrainer:
    """A GRPOTrainer ready to train."""
    return GRPOTrainer(
        model=model,
        reward_funcs=list(rewards),  # type: ignore[arg-type]  # TRL also accepts list[float]
        args=build_config(args),
        train_dataset=dataset,
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
