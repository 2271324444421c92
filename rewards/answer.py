"""Rewards that check the answer against the `ground_truth` column."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rewards._text import (
    _ANSWER_TAG,
    Completion,
    as_list,
    completion_text,
    extract_answer,
    normalize_number,
)

_INTEGER = re.compile(r"[-+]?\d+")

MATH_VERIFY_TIMEOUT_S = 5
"""Longest math-verify may take to parse and compare one answer; slower counts as wrong."""


def _same_answer(given: str | None, truth: Any) -> bool:
    if given is None or truth is None:
        return False
    expected = normalize_number(str(truth))
    if given == expected:
        return True
    try:
        return float(given) == float(expected)
    except ValueError:
        return False


def correctness(
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    ground_truth: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """1.0 when the completion's answer equals `ground_truth` (as text or as a number), else 0.0.

    >>> correctness(["q"], ["<answer>1,000</answer>"], ground_truth=["1000"])
    [1.0]
    >>> correctness(["q"], [[{"role": "assistant", "content": "#### 7"}]], ground_truth=["8"])
    [0.0]
    """
    truths = as_list(ground_truth, len(completions))
    return [
        1.0 if _same_answer(extract_answer(completion_text(c)), t) else 0.0
        for c, t in zip(completions, truths, strict=True)
    ]


def int_answer(
    prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
) -> list[float]:
    """1.0 when the completion's answer is an integer, else 0.0: a nudge towards GSM8K answers.

    >>> int_answer(["q", "q"], ["<answer>12</answer>", "<answer>twelve</answer>"])
    [1.0, 0.0]
    """
    scores = []
    for completion in completions:
        answer = extract_answer(completion_text(completion))
        scores.append(1.0 if answer is not None and _INTEGER.fullmatch(answer) else 0.0)
    return scores


def math_equivalence(
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    ground_truth: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    """1.0 when math-verify finds the completion's answer mathematically equal to `ground_truth`.

    >>> math_equivalence(["q"], ["<answer>$\\\\frac{1}{2}$</answer>"], ground_truth=["0.5"])
    [1.0]
    >>> math_equivalence(["q"], ["<answer>3</answer>"], ground_truth=["0.5"])
    [0.0]
    """
    truths = as_list(ground_truth, len(completions))
    return [_math_equal(completion_text(c), t) for c, t in zip(completions, truths, strict=True)]


def _math_equal(text: str, truth: Any) -> float:
    if truth is None:
        return 0.0
    tagged = _ANSWER_TAG.findall(text)
    candidate = tagged[-1] if tagged else text
    if threading.current_thread() is threading.main_thread():
        return _verify(str(truth), candidate, MATH_VERIFY_TIMEOUT_S)
    # math-verify times itself out with SIGALRM, which only the main thread may use: elsewhere
    # it refuses (and we used to score 0). There, run it without its timeout in a helper thread
    # and stop waiting after the same time.
    _hide_timeout_off_warning()
    return within(MATH_VERIFY_TIMEOUT_S, lambda: _verify(str(truth), candidate, None))


def _verify(truth: str, candidate: str, timeout_s: int | None) -> float:
    from math_verify import parse, verify

    try:
        gold = parse(truth, parsing_timeout=timeout_s)  # type: ignore[arg-type]
        given = parse(candidate, parsing_timeout=timeout_s)  # type: ignore[arg-type]
        # math-verify returns [] when it can extract nothing; that is a wrong answer, not an error.
        return 1.0 if gold and given and verify(gold, given, timeout_seconds=timeout_s) else 0.0
    except Exception:  # noqa: BLE001 - a reward must score a malformed completion, never crash training
        return 0.0


def within(seconds: float, score: Callable[[], float]) -> float:
    """`score()` run in a daemon thread, or 0.0 if it takes longer than `seconds`.

    Python cannot stop a thread: one that overruns (sympy on a pathological expression) is
    left to finish in the background, and training goes on without it.
    """
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(score()), daemon=True)
    worker.start()
    worker.join(seconds)
    return result[0] if result else 0.0


class _OwnTimeout(logging.Filter):
    """Drops math-verify's warning that its timeout is off: `within` provides one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_OWN_TIMEOUT = _OwnTimeout()


def _hide_timeout_off_warning() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _OWN_TIMEOUT not in logger.filters:
            logger.addFilter(_OWN_TIMEOUT)
