"""Helpers shared by the reward functions: completion text and answer extraction."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

Completion = str | Sequence[Mapping[str, Any]]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def completion_text(completion: Completion) -> str:
    """Return the text of a plain (str) or conversational (list of messages) completion.

    >>> completion_text("42")
    '42'
    >>> completion_text([{"role": "assistant", "content": "42"}])
    '42'
    """
    if isinstance(completion, str):
        return completion
    return "\n".join(_content_text(message.get("content")) for message in completion)


def _content_text(content: Any) -> str:
    # Newer chat formats carry content as a list of typed parts: keep the text ones.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def normalize_number(text: str) -> str:
    """Strip the decoration around a numeric answer: whitespace, `$`, commas, a final period.

    >>> normalize_number(" $1,234. ")
    '1234'
    """
    return text.strip().replace(",", "").replace("$", "").strip().rstrip(".").strip()


def ground_truth_from_answer(answer: str) -> str:
    """Return the final answer of a GSM8K-style solution (the part after `####`), normalized.

    >>> ground_truth_from_answer("3 + 4 = 7\\n#### 7")
    '7'
    >>> ground_truth_from_answer("$1,000")
    '1000'
    """
    return normalize_number(answer.split("####")[-1])


def extract_answer(text: str) -> str | None:
    """Return the answer a completion gives: the last `<answer>` block, the part after `####`,
    or else the last number in the text; None when there is none.

    >>> extract_answer("<think>\\n2+2\\n</think>\\n<answer>\\n4\\n</answer>")
    '4'
    >>> extract_answer("so the total is 1,200 apples") is None
    False
    """
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return normalize_number(tagged[-1])
    if "####" in text:
        return normalize_number(text.split("####")[-1])
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def as_list(value: Any, length: int) -> list[Any]:
    """Broadcast a per-batch value (a list with one entry per completion) or a scalar to a list."""
    if isinstance(value, list | tuple):
        return list(value)
    return [value] * length
