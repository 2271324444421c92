"""GuardedReward and ScoreTally on tables of what a reward function can do wrong."""

from __future__ import annotations

import asyncio
import functools
import math
import pickle
import threading
import time
import urllib.error
from typing import Any

import pytest

from rewards import BUILTIN_REWARDS
from rewards.answer import within
from training.errors import TransientError, UsageError, exit_code_for
from training.reward_guard import ScoreTally, check_scores, guard

PROMPTS = ["p1", "p2"]
COMPLETIONS = ["c1", "c2"]


def _returning(value: Any):
    def my_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> Any:
        return value

    return my_reward


def _raising(exc: BaseException):
    def my_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> Any:
        raise exc

    return my_reward


def _chained(outer: Exception, inner: BaseException) -> Exception:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except Exception as exc:
        return exc


# (what the reward does, exit code, message after "reward function mod:my_reward ")
BROKEN = [
    (_returning(None), 64, "returned None instead of 2 scores"),
    (_returning(0.5), 64, "returned a float, not a list of scores"),
    (_returning("0.5"), 64, "returned a str, not a list of scores"),
    (_returning({"a": 1.0, "b": 2.0}), 64, "returned a dict, not a list of scores"),
    (_returning({1.0, 0.0}), 64, "returned a set, not a list of scores"),
    (_returning([1.0]), 64, "returned 1 scores for 2 completions"),
    (_returning([1.0, 0.0, 1.0]), 64, "returned 3 scores for 2 completions"),
    (_returning([1.0, "high"]), 64, "returned 'high' (str) as score 1, not a number"),
    (_returning([[1.0], 0.0]), 64, "returned [1.0] (list) as score 0, not a number"),
    (_returning([float("inf"), 0.0]), 64, "returned inf as score 0"),
    (_raising(KeyError("answer")), 64, "raised KeyError: 'answer'"),
    (_raising(ZeroDivisionError("division by zero")), 64, "raised ZeroDivisionError: division"),
    (_raising(ValueError("line one\nline two")), 64, "raised ValueError: line one"),
    (_raising(TimeoutError("judge timed out")), 75, "raised TimeoutError: judge timed out"),
    (_raising(ConnectionRefusedError(111, "refused")), 75, "raised ConnectionRefusedError"),
    (_raising(ConnectionResetError("reset by peer")), 75, "raised ConnectionResetError"),
    (
        _raising(_chained(urllib.error.URLError("judge down"), TimeoutError("timed out"))),
        75,
        "raised URLError",
    ),
    (_raising(RuntimeError("CUDA out of memory. Tried")), 75, "raised RuntimeError: CUDA out"),
]


@pytest.mark.parametrize(("func", "code", "message"), BROKEN, ids=[b[2][:40] for b in BROKEN])
def test_a_broken_reward_stops_with_one_line_naming_it(func: Any, code: int, message: str):
    # The test conftest sets HF_HUB_OFFLINE: a reward's own connection errors stay transient.
    guarded = guard(func, "mod:my_reward", ScoreTally())
    with pytest.raises((UsageError, TransientError)) as raised:
        guarded(PROMPTS, COMPLETIONS)
    assert exit_code_for(raised.value) == code
    text = str(raised.value)
    assert "\n" not in text
    assert text.startswith(f"reward function mod:my_reward {message}"), text


@pytest.mark.parametrize(
    ("result", "scores"),
    [
        ([1.0, 0.0], [1.0, 0.0]),
        ((1, True), [1.0, 1.0]),
        ([None, 0.25], [None, 0.25]),
        ([float("nan"), -2.0], [math.nan, -2.0]),
    ],
)
def test_good_results_pass_as_floats_or_none(result: Any, scores: list[float | None]):
    checked = check_scores("f", result, 2)
    assert [None if s is None else pytest.approx(s, nan_ok=True) for s in checked] == scores


def test_numpy_and_torch_scalars_are_numbers():
    import numpy as np
    import torch

    assert check_scores("f", [np.float32(0.5), torch.tensor(1.0)], 2) == [0.5, 1.0]
    assert check_scores("f", np.array([0.5, 1.0]), 2) == [0.5, 1.0]
    assert check_scores("f", torch.tensor([0.5, 1.0]), 2) == [0.5, 1.0]
    with pytest.raises(UsageError, match="returned a Tensor, not a list of scores"):
        check_scores("f", torch.tensor(1.0), 2)


def test_the_wrapper_keeps_trl_s_name_and_pickles():
    tally = ScoreTally()
    plain = guard(BUILTIN_REWARDS["correctness"], "correctness", tally)
    partial = guard(
        functools.partial(BUILTIN_REWARDS["keyword_match"], fixed_keywords=["x"]), "kw", tally
    )
    assert (plain.__name__, partial.__name__) == ("correctness", "keyword_match")
    assert pickle.loads(pickle.dumps(plain))(["q"], ["<answer>3</answer>"], ground_truth=["3"])
    from trl.trainer.utils import get_callable_name, is_async_callable

    assert get_callable_name(plain) == "correctness"
    assert not is_async_callable(plain)


def test_an_async_reward_stays_async_and_is_checked():
    from trl.trainer.utils import is_async_callable

    async def judge(prompts: list[Any], completions: list[Any], **kwargs: Any) -> Any:
        return [1.0]

    guarded = guard(judge, "mod:judge", ScoreTally())
    assert is_async_callable(guarded) and guarded.__name__ == "judge"
    with pytest.raises(UsageError, match="mod:judge returned 1 scores for 2 completions"):
        asyncio.run(guarded(PROMPTS, COMPLETIONS))


def _step(tally: ScoreTally, *batches: list[float | None]) -> None:
    for scores in batches:
        tally.record(scores)
    tally.end_step(["a", "b"])


def test_tally_stops_after_the_limit_of_unscored_steps_in_a_row():
    tally = ScoreTally(3)
    nan = float("nan")
    _step(tally, [None, None], [nan, nan])
    _step(tally, [None, None], [nan, nan])
    _step(tally, [None, 0.0], [nan, nan])  # One score is enough: the count starts over.
    _step(tally)  # No reward calls this step (a reused generation batch): neither counts.
    _step(tally, [None, None])
    _step(tally, [nan, None])
    with pytest.raises(UsageError) as raised:
        _step(tally, [None, None], [nan, nan])
    assert str(raised.value) == (
        "reward functions a, b gave no score (None or NaN) to any completion for 3 steps in a row"
    )


def test_tally_with_limit_zero_never_stops():
    tally = ScoreTally(0)
    for _ in range(10):
        _step(tally, [None, None])
    assert tally.unscored_steps == 10


def test_the_guard_reports_to_the_tally():
    tally = ScoreTally(1)
    guard(_returning([None, float("nan")]), "f", tally)(PROMPTS, COMPLETIONS)
    with pytest.raises(UsageError, match="for 1 steps in a row"):
        tally.end_step(["f"])


# math_equivalence called from a worker thread, as TRL may (async rewards, a trainer run in a
# thread): math-verify's SIGALRM timeout refuses there, and the reward used to score 0.
MATH_CASES = [
    ("<answer>$\\frac{3}{4}$</answer>", "0.75", 1.0),
    ("<answer>x = 2</answer>", "2", 1.0),
    ("<answer>$\\sqrt{16}$</answer>", "4", 1.0),
    ("<answer>3</answer>", "4", 0.0),
]


@pytest.mark.parametrize(("completion", "truth", "expected"), MATH_CASES)
def test_math_equivalence_scores_right_answers_off_the_main_thread(
    completion: str, truth: str, expected: float
):
    results: list[list[float]] = []
    worker = threading.Thread(
        target=lambda: results.append(
            BUILTIN_REWARDS["math_equivalence"](["q"], [completion], ground_truth=[truth])
        )
    )
    worker.start()
    worker.join(60)
    assert results == [[expected]]


def test_within_gives_up_on_a_slow_score():
    started = time.monotonic()
    assert within(0.2, lambda: time.sleep(5) or 1.0) == 0.0
    assert time.monotonic() - started < 2
    assert within(5, lambda: 1.0) == 1.0


def test_with_several_processes_a_step_counts_as_scored_when_any_process_scored():
    # This process scored nothing, another one did: the run's step was scored, and every
    # process must reach the same verdict or one stops alone while the others wait for it.
    tally = ScoreTally(max_unscored_steps=1)
    seen: list[tuple[bool, bool]] = []

    def another_process_scored(called: bool, scored: bool) -> tuple[bool, bool]:
        seen.append((called, scored))
        return True, True

    tally.record([None, None])
    tally.end_step(["f"], another_process_scored)
    assert seen == [(True, False)] and tally.unscored_steps == 0

    # A step with no reward calls here still takes part in the collective (every process
    # calls it at every step) and counts when another process called its rewards.
    with pytest.raises(UsageError, match="for 1 steps in a row"):
        tally.end_step(["f"], lambda called, scored: (True, False))


def test_rewards_get_their_arguments_by_name_as_trl_passes_them():
    # TRL's own rewards (think_format_reward(completions, **kwargs)) take no `prompts`
    # positionally: TRL calls every reward with keywords, and so must the guard.
    def completions_only(completions: list[Any], **kwargs: Any) -> list[float]:
        assert kwargs["prompts"] == PROMPTS
        return [1.0] * len(completions)

    async def completions_only_async(completions: list[Any], **kwargs: Any) -> list[float]:
        return [0.5] * len(completions)

    tally = ScoreTally(3)
    assert guard(completions_only, "c", tally)(PROMPTS, COMPLETIONS) == [1.0, 1.0]
    scores = asyncio.run(guard(completions_only_async, "a", tally)(PROMPTS, COMPLETIONS))
    assert scores == [0.5, 0.5]
