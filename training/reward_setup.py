"""Resolve `--reward_function` / `--keywords` into the reward callables handed to TRL.

Kept free of trl/torch imports (unless a TRL reward is named) so that a bad reward name fails
in a fraction of a second.
"""

from __future__ import annotations

import functools

from rewards import BUILTIN_REWARDS, REQUIRED_COLUMNS, RewardError, RewardFunc, load_reward
from rewards.keywords import keyword_match
from training.args import ScriptArguments
from training.errors import UsageError
from training.reward_guard import GuardedReward, ScoreTally, callable_name, guard

TRL_SCRIPT_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                      "get_soft_overlong_punishment")  # fmt: skip
"""The reward names `trl grpo` knows (its script's registry), loaded from trl.rewards."""
TRL_REQUIRED_COLUMNS = {"accuracy_reward": "solution", "reasoning_accuracy_reward": "solution"}


def resolve_reward(spec: str) -> RewardFunc:
    """The reward `spec` names: rlfleet's built-ins and `module:function` first, then
    `trl grpo`'s names (TRL's rewards, get_soft_overlong_punishment with the script's
    max_completion_len=1280, soft_punish_cache=256) and dotted paths `package.module.function`."""
    if spec in BUILTIN_REWARDS or ":" in spec:
        return load_reward(spec, BUILTIN_REWARDS)
    if spec in TRL_SCRIPT_REWARDS:
        import importlib

        func = getattr(importlib.import_module("trl.rewards"), spec)
        if spec == "get_soft_overlong_punishment":
            func = func(max_completion_len=1280, soft_punish_cache=256)
        return func  # type: ignore[no-any-return]
    if "." in spec.strip("."):
        module, _, name = spec.rpartition(".")
        return load_reward(f"{module}:{name}", BUILTIN_REWARDS)
    known = ", ".join([*sorted(BUILTIN_REWARDS), *TRL_SCRIPT_REWARDS])
    raise RewardError(
        f"unknown reward function {spec!r}: use one of {known}, module:function or a dotted path"
    )


def build_rewards(
    args: ScriptArguments, tally: ScoreTally
) -> tuple[list[GuardedReward], dict[str, str]]:
    """The reward callables for `--reward_function`, each guarded and reporting to `tally`,
    and the dataset columns they need."""
    funcs: list[GuardedReward] = []
    required: dict[str, str] = {}
    for spec in args.reward_function:
        try:
            func = resolve_reward(spec)
        except RewardError as exc:
            raise UsageError(str(exc)) from exc
        if func is keyword_match:
            if args.keywords:
                # A partial keeps TRL's metric name (`rewards/keyword_match/mean`) and pickles.
                func = functools.partial(keyword_match, fixed_keywords=list(args.keywords))
            else:
                required[spec] = "keywords"
        if spec in REQUIRED_COLUMNS:
            required[spec] = REQUIRED_COLUMNS[spec]
        if spec in TRL_REQUIRED_COLUMNS:
            required[spec] = TRL_REQUIRED_COLUMNS[spec]
        funcs.append(guard(func, spec, tally))
    return funcs, required


def reward_names(funcs: list[RewardFunc] | list[GuardedReward]) -> list[str]:
    """The names TRL logs each reward under."""
    return [callable_name(func) for func in funcs]
