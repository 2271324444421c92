"""Rewards that check the answer against the `ground_truth` column."""

from __future__ import annotations

import re
from collections.abc import Sequence
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
    from math_verify import parse, verify

    if truth is None:
        return 0.0
    tagged = _ANSWER_TAG.findall(text)
    candidate = tagged[-1] if tagged else text
    try:
        gold = parse(str(truth))
        given = parse(candidate)
        # math-verify returns [] when it can extract nothing; that is a wrong answer, not an error.
        return 1.0 if gold and given and verify(gold, given) else 0.0
    except Exception:  # noqa: BLE001 - a reward must score a malformed completion, never crash training
        return 0.0
