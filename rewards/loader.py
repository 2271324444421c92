"""Turn `--reward_function` values (a built-in name or `module:function`) into callables."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

RewardFunc = Callable[..., list[float]]


class RewardError(ValueError):
    """A reward function could not be resolved; the message is meant for the user as is."""


def load_reward(spec: str, builtins: Mapping[str, RewardFunc]) -> RewardFunc:
    """Return the built-in reward named `spec`, or import `module:function` from the working
    directory or PYTHONPATH."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        known = ", ".join(sorted(builtins))
        raise RewardError(
            f"unknown reward function {spec!r}: use one of {known} or module:function"
        )
    module_name, _, attr = spec.partition(":")
    module = _import(module_name, spec)
    func = getattr(module, attr, None)
    if func is None:
        raise RewardError(
            f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}"
        )
    if not callable(func):
        raise RewardError(
            f"reward function {spec!r}: {attr!r} is a {type(func).__name__}, not callable"
        )
    return func  # type: ignore[no-any-return]


def _import(module_name: str, spec: str) -> Any:
    # `python -m` and console scripts do not put the working directory on sys.path; users
    # expect `mymodule:fn` to find ./mymodule.py as it would with `python script.py`.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # The module itself (or a package on its dotted path) is missing, as opposed to a
        # dependency it imports: `mathlib_rewards` failing on `import mathlib` is the latter.
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise RewardError(f"reward function {spec!r}: no module named {module_name!r}") from exc
        raise RewardError(
            f"reward function {spec!r}: importing {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - user code may raise anything while importing
        raise RewardError(
            f"reward function {spec!r}: importing {module_name!r} failed: {exc!r}"
        ) from exc
