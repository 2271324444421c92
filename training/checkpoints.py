"""Choosing the checkpoint to resume from."""

from __future__ import annotations

import re
from pathlib import Path

from training.errors import UsageError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The highest-numbered complete `checkpoint-N` in output_dir, or None.

    A checkpoint counts as complete once `trainer_state.json` is in it: the trainer writes that
    file last, so a save cut short by a crash is skipped rather than resumed from.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _CHECKPOINT.match(path.name)) and (path / "trainer_state.json").is_file()
    ]
    return max(complete)[1] if complete else None


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint path for `--resume`: None (fresh start), `auto`, or an explicit directory."""
    if resume is None:
        return None
    if resume == "auto":
        found = newest_checkpoint(output_dir)
        return str(found) if found else None
    if not (Path(resume) / "trainer_state.json").is_file():
        raise UsageError(f"--resume {resume}: not a checkpoint directory (no trainer_state.json)")
    return resume
