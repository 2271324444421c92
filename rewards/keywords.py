"""Reward for mentioning keywords, given on the command line or per row in a `keywords` column."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rewards._text import Completion, as_list, completion_text


def parse_keywords(value: Any) -> list[str]:
    """Return keywords from a list or a comma-separated string, stripped, empty ones dropped.

    >>> parse_keywords("cat, dog,,")
    ['cat', 'dog']
    >>> parse_keywords(["Sun", " moon "])
    ['Sun', 'moon']
    """
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item).strip() for item in items if str(item).strip()]


def keyword_match(
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    keywords: Sequence[Any] | None = None,
    fixed_keywords: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[float]:
    """The fraction of the keywords that appear as whole words in the completion, ignoring case.

    Keywords are `fixed_keywords` (from `--keywords`) when given, else the row's `keywords` column.

    >>> keyword_match(["q"], ["The Cat sat"], keywords=[["cat", "dog"]])
    [0.5]
    >>> chat = [[{"role": "assistant", "content": "concatenate"}]]
    >>> keyword_match(["q"], chat, fixed_keywords=["cat"])
    [0.0]
    """
    per_row = (
        [fixed_keywords] * len(completions)
        if fixed_keywords is not None
        else as_list(keywords, len(completions))
    )
    return [
        _fraction_found(completion_text(c), parse_keywords(k))
        for c, k in zip(completions, per_row, strict=True)
    ]


def _fraction_found(text: str, keywords: list[str]) -> float:
    if not keywords:
        return 0.0
    found = sum(
        1 for k in keywords if re.search(rf"(?<!\w){re.escape(k)}(?!\w)", text, re.IGNORECASE)
    )
    return found / len(keywords)
