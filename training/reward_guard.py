"""Check what each reward function returns, so a broken one stops training with one clear line.

TRL calls reward functions deep inside a training step: an exception there, a wrong-length or
None result, or a step in which nothing was scored would otherwise end in a traceback or, worse,
in a run that "finishes" having learned nothing. Each reward is wrapped in a `GuardedReward`,
which names the function in its error, and reports to a shared `ScoreTally`, which the trainer
asks at the end of every step whether any completion got a score.

Kept free of trl/torch imports, like `training.reward_setup`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

from rewards import RewardFunc
from training.errors import (
    TransientError,
    UsageError,
    is_network_timeout,
    is_out_of_memory,
    one_line,
)
from trlspec.flags import DEFAULT_MAX_UNSCORED_STEPS


def callable_name(func: Any) -> str:
    """The name TRL logs a reward under: a partial's inner function's, else `__name__`."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async(func: Any) -> bool:
    """True when calling `func` returns a coroutine (async function, partial of one, or class)."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)  # noqa: B004 - the method itself, not callable()
    )


class ScoreTally:
    """Counts consecutive training steps in which no reward function scored any completion."""

    def __init__(self, max_unscored_steps: int = DEFAULT_MAX_UNSCORED_STEPS) -> None:
        self.max_unscored_steps = max_unscored_steps  # 0: never stop.
        self.unscored_steps = 0
        self._calls = 0
        self._scored = False

    def record(self, scores: Sequence[float | None]) -> None:
        """Note one reward function's scores for a batch of completions."""
        self._calls += 1
        self._scored = self._scored or any(
            score is not None and not math.isnan(score) for score in scores
        )

    def end_step(
        self,
        names: Sequence[str],
        combine: Callable[[bool, bool], tuple[bool, bool]] | None = None,
    ) -> None:
        """Close a training step; UsageError after too many unscored steps in a row.

        A step without reward calls (TRL reuses one generation batch for several steps) neither
        counts nor resets. With several processes, `combine` turns this process's (called,
        scored) into the whole run's (any process called, any scored), so that every process
        counts the same steps and all of them stop together, or none does.
        """
        called, scored = self._calls > 0, self._scored
        self._calls, self._scored = 0, False
        if combine is not None:
            called, scored = combine(called, scored)
        if not called:
            return
        self.unscored_steps = 0 if scored else self.unscored_steps + 1
        if 0 < self.max_unscored_steps <= self.unscored_steps:
            raise UsageError(
                f"reward functions {', '.join(names)} gave no score (None or NaN) to any "
                f"completion for {self.unscored_steps} steps in a row"
            )


def check_scores(name: str, result: Any, expected: int) -> list[float | None]:
    """`result` as a list of `expected` scores (float or None); UsageError naming `name` if not."""
    if result is None:
        raise UsageError(f"reward function {name} returned None instead of {expected} scores")
    # TRL takes any sized iterable: a list, a tuple, a numpy array, a 1-d tensor.
    try:
        scores = None if isinstance(result, str | bytes | Mapping | Set) else list(result)
    except TypeError:  # Not iterable, or a 0-d array.
        scores = None
    if scores is None:
        raise UsageError(
            f"reward function {name} returned a {type(result).__name__}, not a list of scores"
        )
    if len(scores) != expected:
        raise UsageError(
            f"reward function {name} returned {len(scores)} scores for {expected} completions"
        )
    return [_score(name, index, value) for index, value in enumerate(scores)]


def _score(name: str, index: int, value: Any) -> float | None:
    if value is None:  # TRL's "does not apply to this completion": NaN, ignored by the mean.
        return None
    try:
        if isinstance(value, str | bytes):
            raise TypeError
        score = float(value)
    except (TypeError, ValueError):
        raise UsageError(
            f"reward function {name} returned {value!r} ({type(value).__name__}) as score "
            f"{index}, not a number"
        ) from None
    if math.isinf(score):
        raise UsageError(f"reward function {name} returned {score} as score {index}")
    return score


def failure(name: str, exc: Exception) -> Exception:
    """The error to stop with when reward function `name` raised `exc`.

    Timeouts, refused connections and out-of-memory are TransientError (exit 75: a retry may
    succeed), anything else UsageError (exit 64: the function is broken).
    """
    what = f"reward function {name} raised {type(exc).__name__}: {one_line(exc)}"
    if is_out_of_memory(exc) or is_network_timeout(exc, hub=False):
        return TransientError(what)
    return UsageError(what)


class GuardedReward:
    """A reward function that checks its results and names itself in every failure.

    Carries the inner function's `__name__`, so TRL logs it as before (`rewards/<name>/mean`).
    """

    def __init__(self, func: RewardFunc, spec: str, tally: ScoreTally) -> None:
        self.func = func
        self.spec = spec  # As the user gave it: what the error line names.
        self.tally = tally
        self.__name__ = callable_name(func)
        self.__doc__ = getattr(func, "__doc__", None)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> Any:
        """Call the reward function and check what it returned."""
        try:
            result = self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:
            raise failure(self.spec, exc) from exc
        return self._checked(result, len(completions))

    def _checked(self, result: Any, expected: int) -> list[float | None]:
        scores = check_scores(self.spec, result, expected)
        self.tally.record(scores)
        return scores


class AsyncGuardedReward(GuardedReward):
    """GuardedReward for an async reward function, which TRL awaits alongside the others."""

    async def __call__(  # type: ignore[override]
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        """Await the reward function and check what it returned."""
        try:
            result = await self.func(  # type: ignore[misc]
                prompts=prompts, completions=completions, **kwargs
            )
        except Exception as exc:
            raise failure(self.spec, exc) from exc
        return self._checked(result, len(completions))


def guard(func: RewardFunc, spec: str, tally: ScoreTally) -> GuardedReward:
    """Wrap `func` (the reward `spec` names) so its failures and results are checked."""
    kind = AsyncGuardedReward if is_async(func) else GuardedReward
    return kind(func, spec, tally)
