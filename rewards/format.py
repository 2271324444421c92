"""Rewards for the `<think>…</think><answer>…</answer>` format of the deepseek preprocessing."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rewards._text import Completion, completion_text

# DOTALL: the reasoning spans several lines, and `.` must cross them.
_STRICT = re.compile(r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\n?", re.DOTALL)
_SOFT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def strict_format(
    prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
) -> list[float]:
    """1.0 when the completion is exactly `<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>`.

    >>> strict_format(["q"], ["<think>\\na\\nb\\n</think>\\n<answer>\\n4\\n</answer>"])
    [1.0]
    >>> strict_format(["q"], ["<think>a</think><answer>4</answer>"])
    [0.0]
    """
    return [1.0 if _STRICT.fullmatch(completion_text(c)) else 0.0 for c in completions]


def soft_format(
    prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
) -> list[float]:
    """1.0 when the completion is a think block then an answer block, whatever the whitespace.

    >>> soft_format(["q"], ["<think>a\\nb</think> <answer>4</answer>"])
    [1.0]
    >>> soft_format(["q"], ["the answer is 4"])
    [0.0]
    """
    return [1.0 if _SOFT.fullmatch(completion_text(c)) else 0.0 for c in completions]


_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def xml_count(
    prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
) -> list[float]:
    """0.25 for each of the four tags present exactly once, less 0.001 per character after
    `</answer>`, never below 0: a dense signal that leads towards the strict format.

    >>> xml_count(["q"], ["<think>x</think><answer>4</answer>"])
    [1.0]
    >>> xml_count(["q"], ["<think>x</think>"])
    [0.5]
    """
    return [_xml_score(completion_text(c)) for c in completions]


def _xml_score(text: str) -> float:
    score = sum(0.25 for tag in _TAGS if text.count(tag) == 1)
    if text.count("</answer>") == 1:
        trailing = text.split("</answer>", 1)[1].strip()
        score -= 0.001 * len(trailing)
    return max(0.0, round(score, 6))
