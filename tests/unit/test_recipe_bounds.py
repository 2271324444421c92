"""A recipe (`job submit --config`, train_grpo.py's `--config`) is read with the same bounded
loader as a job file (`-f`): no YAML aliases, bounded depth and size (issue 29, point 8: a
654-byte "billion laughs" recipe took the CLI past 2 GiB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LEVELS = 9
LAUGHS = (
    "model_name_or_path: [&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol], "
    + ", ".join(f"&a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, LEVELS))
    + "]\n"
)
"""Nested aliases: a few hundred bytes that name 9**9 strings when walked."""

_BOUNDED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
{body}
"""


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`body` in a python of its own, its memory capped at 1 GiB and its time at 60 s, so
    that a loader that expands the aliases fails this test instead of the machine."""
    code = _BOUNDED.format(body=body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )


@pytest.fixture
def laughs(tmp_path: Path) -> Path:
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    assert len(LAUGHS) < 1000
    return path


def test_submit_config_refuses_a_recipe_with_aliases_like_a_job_file(
    laughs: Path, tmp_path: Path
) -> None:
    body = f"""
from scheduler.errors import BadInput
from scheduler.cli.jobfile import from_recipe
try:
    from_recipe({str(laughs)!r}, None, None, (), ())
except BadInput as exc:
    print("refused:", exc)
"""
    done = _run(body, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"refused: --config {laughs}:"), done.stdout
    assert "YAML aliases (*name) are not allowed" in done.stdout


def test_train_grpo_config_refuses_a_recipe_with_aliases(laughs: Path, tmp_path: Path) -> None:
    body = f"""
from training.args import RecipeError, read_recipe
try:
    read_recipe({str(laughs)!r})
except RecipeError as exc:
    print("refused:", exc)
"""
    done = _run(body, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"refused: --config {laughs}"), done.stdout
    assert "aliases" in done.stdout


def test_a_recipe_larger_than_a_job_file_may_be_is_refused(tmp_path: Path) -> None:
    from training.args import RecipeError, read_recipe

    path = tmp_path / "big.yaml"
    path.write_text("model_name_or_path: m\n" + "# padding\n" * 200_000)
    with pytest.raises(RecipeError, match="larger than"):
        read_recipe(str(path))
