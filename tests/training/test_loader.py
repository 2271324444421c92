"""`--reward_function module:function` resolution."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rewards import BUILTIN_REWARDS, RewardError, load_reward


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """./my_rewards_mod.py in a fresh working directory that is not on sys.path, as under
    `python -m` or a console script: only the loader's own cwd handling can find it."""
    (tmp_path / "my_rewards_mod.py").write_text(
        "def length_reward(prompts, completions, **kwargs):\n"
        "    return [float(len(c)) for c in completions]\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    cwd_entries = {"", ".", str(tmp_path), os.getcwd()}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in cwd_entries])
    yield tmp_path
    sys.modules.pop("my_rewards_mod", None)


def test_builtin_name_resolves_to_the_builtin():
    assert load_reward("correctness", BUILTIN_REWARDS) is BUILTIN_REWARDS["correctness"]


def test_module_function_is_imported_from_the_working_directory(user_module: Path):
    func = load_reward("my_rewards_mod:length_reward", BUILTIN_REWARDS)
    assert func(["p"], ["abc"]) == [3.0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", "unknown reward function 'nonsense'"),
        ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
        ("my_rewards_mod:missing", "has no attribute 'missing'"),
        ("my_rewards_mod:NOT_CALLABLE", "is a int, not callable"),
    ],
)
def test_bad_specs_raise_a_clear_error(user_module: Path, spec: str, message: str):
    with pytest.raises(RewardError, match=message):
        load_reward(spec, BUILTIN_REWARDS)


def test_a_missing_dependency_is_named_not_mistaken_for_the_module(user_module: Path):
    # `mathlib` is a prefix of the module's own name; it must still be reported as what failed.
    (user_module / "mathlib_rewards.py").write_text("import mathlib\n")
    try:
        with pytest.raises(RewardError) as info:
            load_reward("mathlib_rewards:f", BUILTIN_REWARDS)
    finally:
        sys.modules.pop("mathlib_rewards", None)
    assert "importing 'mathlib_rewards' failed: No module named 'mathlib'" in str(info.value)


def test_a_missing_package_on_the_dotted_path_is_the_module_missing(user_module: Path):
    with pytest.raises(RewardError, match="no module named 'no_such_pkg_xyz.rewards'"):
        load_reward("no_such_pkg_xyz.rewards:f", BUILTIN_REWARDS)
