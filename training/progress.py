"""progress.json: what the scheduler (and `rlfleet job show`) reads about a running attempt."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

PROGRESS_ENV = "RLFLEET_PROGRESS_FILE"


def progress_path(output_dir: str) -> Path:
    """`$RLFLEET_PROGRESS_FILE` when set, else `<output_dir>/progress.json`."""
    return Path(os.environ.get(PROGRESS_ENV) or Path(output_dir) / "progress.json")


def write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def eta_seconds(elapsed: float, done: int, remaining: int) -> float | None:
    """Seconds left at the pace of this run so far; None before the first step.

    >>> eta_seconds(10.0, 2, 6)
    30.0
    """
    if done <= 0:
        return None
    return round(elapsed / done * remaining, 1)


class ProgressCallback(TrainerCallback):
    """Rewrites progress.json at every logging step, from the main process of each node.

    Every node of a multi-node run has its own attempt directory for the scheduler to read, so
    each node's first process writes one; the metrics are already gathered over all processes,
    so every node reports the same step and the same rewards.

    `status` is `running`, then `finished`, or `stopped` when `stopped()` says training ended
    early on a SIGTERM (its checkpoint is that of `step`).
    """

    def __init__(
        self, path: Path, reward_names: list[str], stopped: Callable[[], bool] = lambda: False
    ) -> None:
        self.path = path
        self.reward_names = reward_names
        self.stopped = stopped
        self.snapshot: dict[str, Any] = {"rewards": {}, "reward": None, "loss": None}
        self._started = time.monotonic()
        self._start_step = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._started = time.monotonic()
        # After a resume the trainer has already restored global_step from the checkpoint.
        self._start_step = state.global_step
        self._write(state, "running")

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        logs = logs or {}
        rewards = {
            n: logs[f"rewards/{n}/mean"] for n in self.reward_names if f"rewards/{n}/mean" in logs
        }
        if rewards:
            self.snapshot["rewards"] = rewards
        for key in ("reward", "loss"):
            if logs.get(key) is not None:
                self.snapshot[key] = logs[key]
        self._write(state, "running")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._write(state, "stopped" if self.stopped() else "finished")

    def _write(self, state: TrainerState, status: str) -> None:
        if not state.is_local_process_zero:
            return
        elapsed = time.monotonic() - self._started
        data = {
            "status": status,
            "step": state.global_step,
            "max_steps": state.max_steps,
            "start_step": self._start_step,
            **self.snapshot,
            "elapsed_s": round(elapsed, 1),
            "eta_s": eta_seconds(
                elapsed, state.global_step - self._start_step, state.max_steps - state.global_step
            ),
            "updated_at": time.time(),
        }
        write_atomically(self.path, data)
