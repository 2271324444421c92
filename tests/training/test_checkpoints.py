"""Choosing the checkpoint `--resume` continues from."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.checkpoints import agree_on_resume, newest_checkpoint, resolve_resume
from training.errors import UsageError


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"weights")
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


def test_a_checkpoint_without_weights_is_skipped(tmp_path: Path):
    # The other nodes of a multi-node run write the weights after the trainer state.
    two = _checkpoint(tmp_path, 2)
    (_checkpoint(tmp_path, 4) / "model.safetensors").unlink()
    assert newest_checkpoint(tmp_path) == two


def _nodes(*roots: Path):
    """A stand-in for the collective: what each node's process would contribute, in rank order.

    Each node passes its own output_dir; `gather` is called with this process's value, and the
    others' values are computed from their directories the same way.
    """

    def gather_from(local_root: Path):
        def gather(value: object) -> list[object]:
            from training.checkpoints import complete_steps

            if isinstance(value, bool):
                return [value for _ in roots]
            return [complete_steps(root) for root in roots]

        return gather

    return gather_from


def test_auto_resume_takes_the_newest_step_every_node_has(tmp_path: Path):
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    for step in (2, 4, 6):
        _checkpoint(node0, step)
    for step in (2, 4):
        _checkpoint(node1, step)
    _checkpoint(node1, 6, complete=False)
    gather = _nodes(node0, node1)
    assert agree_on_resume("auto", str(node0), gather(node0)) == str(node0 / "checkpoint-4")
    assert agree_on_resume("auto", str(node1), gather(node1)) == str(node1 / "checkpoint-4")


def test_auto_resume_starts_fresh_when_a_node_has_no_checkpoint(tmp_path: Path):
    # A retry that placed one rank on a new VM: nothing to resume from that all ranks share.
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    _checkpoint(node0, 4)
    assert agree_on_resume("auto", str(node0), _nodes(node0, node1)(node0)) is None


def test_an_explicit_checkpoint_missing_on_a_node_is_a_usage_error(tmp_path: Path):
    here = _checkpoint(tmp_path, 3)
    with pytest.raises(UsageError, match="not a complete checkpoint on 1 of the run"):
        agree_on_resume(str(here), str(tmp_path), lambda value: [value, False])
    assert agree_on_resume(str(here), str(tmp_path), lambda value: [value, True]) == str(here)
    assert agree_on_resume(None, str(tmp_path), lambda value: [value, True]) is None
