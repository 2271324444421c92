"""Choosing the checkpoint `--resume` continues from."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.checkpoints import newest_checkpoint, resolve_resume
from training.errors import UsageError


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


def test_newest_is_by_step_number_not_by_name(tmp_path: Path):
    _checkpoint(tmp_path, 9)
    ten = _checkpoint(tmp_path, 10)
    assert newest_checkpoint(tmp_path) == ten


def test_a_checkpoint_cut_short_is_skipped(tmp_path: Path):
    two = _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3, complete=False)
    assert newest_checkpoint(tmp_path) == two


def test_a_checkpoint_with_a_truncated_trainer_state_is_skipped(tmp_path: Path):
    two = _checkpoint(tmp_path, 2)
    three = _checkpoint(tmp_path, 3)
    (three / "trainer_state.json").write_text('{"global_step": 3, "log_hist')
    assert newest_checkpoint(tmp_path) == two
    assert resolve_resume("auto", str(tmp_path)) == str(two)
    with pytest.raises(UsageError, match="not a checkpoint directory"):
        resolve_resume(str(three), str(tmp_path))


def test_auto_without_checkpoints_starts_fresh(tmp_path: Path):
    assert resolve_resume("auto", str(tmp_path / "missing")) is None
    assert resolve_resume(None, str(tmp_path)) is None


def test_explicit_path_must_be_a_checkpoint(tmp_path: Path):
    good = _checkpoint(tmp_path, 1)
    assert resolve_resume(str(good), str(tmp_path)) == str(good)
    with pytest.raises(UsageError, match="not a checkpoint directory"):
        resolve_resume(str(tmp_path / "nope"), str(tmp_path))
