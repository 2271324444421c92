"""Trainer callbacks: stop with a checkpoint on SIGTERM, stop when rewards score nothing, and
complete the checkpoints of the other nodes of a multi-node run.

Imported only after Unsloth (when asked for), because importing transformers comes with it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from training.reward_guard import ScoreTally


class ScoreCheckCallback(TrainerCallback):
    """Ends a step in the ScoreTally, which raises UsageError after too many unscored steps."""

    def __init__(self, tally: ScoreTally, reward_names: Sequence[str]) -> None:
        self.tally = tally
        self.reward_names = list(reward_names)
        self.accelerator: Any = None  # set by the caller: several processes decide together

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.tally.end_step(self.reward_names, self._across_processes)

    def _across_processes(self, called: bool, scored: bool) -> tuple[bool, bool]:
        # Each process scores only its own share of the completions: one whose share went
        # unscored must not stop alone while the others wait for it in the next collective.
        accelerator = self.accelerator
        if accelerator is None or accelerator.num_processes == 1:
            return called, scored
        flags = torch.tensor([int(called), int(scored)], device=accelerator.device)
        total = accelerator.reduce(flags, reduction="sum")
        return bool(total[0].item()), bool(total[1].item())


class StopOnSigterm(TrainerCallback):
    """On SIGTERM, finish the current step, save a checkpoint of it and stop training.

    The signal handler only notes the time; the trainer acts at the end of the step, where a
    checkpoint is consistent. The handler is in place from the start of training to its end;
    a TERM during loading (nothing to save yet) or after training (the final model is being
    written) kills at once. A repeated TERM changes nothing: under `accelerate launch` each
    process gets the group's TERM and then the launcher's own.
    """

    def __init__(self) -> None:
        self.signalled_at: float | None = None  # time.monotonic() of the first TERM
        self.stopped_at_step: int | None = None  # the step checkpointed because of it
        self.accelerator: Any = None  # set by the caller: several processes stop together
        self._installed = False

    @property
    def stopped(self) -> bool:
        """True when training ended early because of a TERM (and its checkpoint was saved)."""
        return self.stopped_at_step is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Only the main thread may set signal handlers; training run from another thread (a
        # notebook, a test) simply keeps the default TERM.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.stopped or not self._anyone_signalled():
            return
        if state.global_step >= state.max_steps:
            return  # The last step: training ends and saves anyway.
        control.should_save = True
        control.should_training_stop = True
        self.stopped_at_step = state.global_step

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False

    def _anyone_signalled(self) -> bool:
        signalled = self.signalled_at is not None
        accelerator = self.accelerator
        if accelerator is None or accelerator.num_processes == 1:
            return signalled
        # Every process gets the TERM, but each notices it at its own point in the step: stop
        # all of them at the same step, or the others wait for ever in the next collective.
        if signalled:
            accelerator.set_trigger()
        return bool(accelerator.check_trigger())


class NodeCheckpointCallback(TrainerCallback):
    """Completes each checkpoint on the nodes other than rank 0's, whose disks are their own.

    With `save_on_each_node` the trainer writes the optimizer, scheduler and trainer state on the
    first process of every node, but transformers writes model weights from global rank 0 only,
    which would leave the other nodes with checkpoints they cannot resume from. The weights are
    the same on every process (data parallel), so each such node writes its own copy.
    """

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        model = kw.get("model")
        if model is None or state.is_world_process_zero:
            return
        if not (args.save_on_each_node and state.is_local_process_zero):
            return
        checkpoint = Path(str(args.output_dir)) / f"checkpoint-{state.global_step}"
        save_weights(model, checkpoint)


def save_weights(model: Any, directory: Path) -> None:
    """Write `model`'s weights (or a PEFT model's adapter) and config where the trainer resumes
    them from; the weights file appears complete or not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "peft_config"):
        # PEFT writes the adapter on whichever process asks.
        model.save_pretrained(str(directory), is_main_process=True)
        return
    from safetensors.torch import save_model

    model.config.to_json_file(str(directory / "config.json"))
    partial = directory / ".model.safetensors.partial"
    save_model(model, str(partial), metadata={"format": "pt"})  # Tied weights stored once.
    os.replace(partial, directory / "model.safetensors")
