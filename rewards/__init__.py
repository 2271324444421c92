"""Built-in GRPO reward functions and the `module:function` loader.

Every reward has TRL's signature `f(prompts, completions, **kwargs) -> list[float]`; dataset
columns (such as `ground_truth` or `keywords`) arrive as keyword arguments.
"""

from __future__ import annotations

from rewards.answer import correctness, int_answer, math_equivalence
from rewards.format import soft_format, strict_format, xml_count
from rewards.keywords import keyword_match, parse_keywords
from rewards.loader import RewardError, RewardFunc, load_reward

BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "correctness": correctness,
    "math_equivalence": math_equivalence,
    "int_answer": int_answer,
    "keyword_match": keyword_match,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xml_count": xml_count,
}

# Dataset columns a built-in reward cannot score without; checked before training starts.
REQUIRED_COLUMNS: dict[str, str] = {
    "correctness": "ground_truth",
    "math_equivalence": "ground_truth",
}

__all__ = [
    "BUILTIN_REWARDS",
    "REQUIRED_COLUMNS",
    "RewardError",
    "RewardFunc",
    "correctness",
    "int_answer",
    "keyword_match",
    "load_reward",
    "math_equivalence",
    "parse_keywords",
    "soft_format",
    "strict_format",
    "xml_count",
]
