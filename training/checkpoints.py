"""Choosing the checkpoint to resume from."""

from __future__ import annotations

import json
import re
from pathlib import Path

from training.errors import UsageError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The highest-numbered complete `checkpoint-N` in output_dir, or None.

    A checkpoint counts as complete once its `trainer_state.json` parses: the trainer writes that
    file last, so a save cut short by a crash (no file, or a truncated one) is skipped rather
    than resumed from, which would fail the same way on every retry.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _CHECKPOINT.match(path.name)) and _is_complete(path)
    ]
    return max(complete)[1] if complete else None


def _is_complete(checkpoint: Path) -> bool:
    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


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
