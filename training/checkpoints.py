"""Choosing the checkpoint to resume from."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.errors import UsageError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The highest-numbered complete `checkpoint-N` in output_dir, or None.

    A checkpoint counts as complete once its `trainer_state.json` parses: the trainer writes that
    file last, so a save cut short by a crash (no file, or a truncated one) is skipped rather
    than resumed from, which would fail the same way on every retry.
    """
    steps = complete_steps(output_dir)
    return Path(output_dir) / f"checkpoint-{steps[-1]}" if steps else None


# Files of which a checkpoint has at least one: full weights, sharded weights or an adapter.
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


def _is_complete(checkpoint: Path) -> bool:
    # The weights too: on the other nodes of a multi-node run they are written after the
    # trainer state (training.callbacks.NodeCheckpointCallback).
    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return any((checkpoint / name).is_file() for name in _WEIGHTS)


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint path for `--resume`: None (fresh start), `auto`, or an explicit directory."""
    if resume is None:
        return None
    if resume == "auto":
        found = newest_checkpoint(output_dir)
        return str(found) if found else None
    if not _is_complete(Path(resume)):
        raise UsageError(
            f"--resume {resume}: not a checkpoint directory (no readable trainer_state.json)"
        )
    return resume


def complete_steps(output_dir: str | Path) -> list[int]:
    """The steps of the complete `checkpoint-N` directories in output_dir, in ascending order."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted(
        int(match.group(1))
        for path in root.iterdir()
        if (match := _CHECKPOINT.match(path.name)) and _is_complete(path)
    )


def agree_on_resume(
    resume: str | None, output_dir: str, gather: Callable[[Any], list[Any]]
) -> str | None:
    """The checkpoint every process of a distributed run resumes from.

    Each node of a multi-node run keeps its own checkpoints on its own disk, and a retried run
    may land on a VM that has none, so `--resume auto` takes the newest step that every process
    has complete (fresh start when there is none): processes that resumed from different steps
    would wait for each other for ever. `gather` collects one value from every process (all of
    them call this function). An explicit `--resume DIR` must exist on every node.
    """
    if resume is None:
        return None
    if resume != "auto":
        missing = sum(1 for ok in gather(_is_complete(Path(resume))) if not ok)
        if missing:
            raise UsageError(
                f"--resume {resume}: not a complete checkpoint on {missing} of the run's processes"
            )
        return resume
    steps = [set(local) for local in gather(complete_steps(output_dir))]
    common = set.intersection(*steps) if steps else set()
    return str(Path(output_dir) / f"checkpoint-{max(common)}") if common else None
