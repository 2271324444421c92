"""Resolve `--reward_function` / `--keywords` into the reward callables handed to TRL.

Kept free of trl/torch imports so that a bad reward name fails in a fraction of a second.
"""

from __future__ import annotations

import functools

from rewards import BUILTIN_REWARDS, REQUIRED_COLUMNS, RewardError, RewardFunc, load_reward
from rewards.keywords import keyword_match
from training.args import ScriptArguments
from training.errors import UsageError
from training.reward_guard import GuardedReward, ScoreTally, callable_name, guard


def build_rewards(
    args: ScriptArguments, tally: ScoreTally
) -> tuple[list[GuardedReward], dict[str, str]]:
    """The reward callables for `--reward_function`, each guarded and reporting to `tally`,
    and the dataset columns they need."""
    funcs: list[GuardedReward] = []
    required: dict[str, str] = {}
    for spec in args.reward_function:
        try:
            func = load_reward(spec, BUILTIN_REWARDS)
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
        funcs.append(guard(func, spec, tally))
    return funcs, required


def reward_names(funcs: list[RewardFunc] | list[GuardedReward]) -> list[str]:
    """The names TRL logs each reward under."""
    return [callable_name(func) for func in funcs]
