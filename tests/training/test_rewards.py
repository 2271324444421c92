"""Every built-in reward on a table of cases, plain and conversational, plus their doctests."""

from __future__ import annotations

import doctest
import importlib

import pytest

from rewards import BUILTIN_REWARDS, REQUIRED_COLUMNS

THINK = "<think>\nFirst, 12 apples.\nThen 3 more.\n12 + 3 = 15\n</think>\n<answer>\n15\n</answer>"

# (reward, completion, kwargs for one row, expected score)
CASES = [
    ("correctness", THINK, {"ground_truth": "15"}, 1.0),
    ("correctness", THINK, {"ground_truth": "16"}, 0.0),
    ("correctness", "<answer>1,500</answer>", {"ground_truth": "1500"}, 1.0),
    ("correctness", "<answer>$15.00</answer>", {"ground_truth": "15"}, 1.0),
    ("correctness", "3 + 4 = 7\n#### 7", {"ground_truth": "7"}, 1.0),
    ("correctness", "so it is 10 or maybe 12", {"ground_truth": "12"}, 1.0),
    ("correctness", "no number here", {"ground_truth": "12"}, 0.0),
    ("correctness", "<answer>12</answer>", {"ground_truth": None}, 0.0),
    ("int_answer", "<answer>-3</answer>", {}, 1.0),
    ("int_answer", "<answer>2.5</answer>", {}, 0.0),
    ("int_answer", "nothing", {}, 0.0),
    ("math_equivalence", "<answer>$\\frac{3}{4}$</answer>", {"ground_truth": "0.75"}, 1.0),
    ("math_equivalence", "<answer>x = 2</answer>", {"ground_truth": "2"}, 1.0),
    ("math_equivalence", "<answer>3</answer>", {"ground_truth": "4"}, 0.0),
    ("math_equivalence", "gibberish )(", {"ground_truth": "4"}, 0.0),
    ("strict_format", THINK, {}, 1.0),
    ("strict_format", THINK + "\n", {}, 1.0),
    ("strict_format", "<think>one line</think>\n<answer>\n15\n</answer>", {}, 0.0),
    ("strict_format", THINK + " and more", {}, 0.0),
    ("strict_format", "15", {}, 0.0),
    ("soft_format", THINK, {}, 1.0),
    ("soft_format", "<think>a\n\nb</think><answer>15</answer>", {}, 1.0),
    ("soft_format", "<answer>15</answer><think>a</think>", {}, 0.0),
    ("soft_format", "<think>a</think>", {}, 0.0),
    ("xml_count", THINK, {}, 1.0),
    ("xml_count", "<think>a</think>", {}, 0.5),
    ("xml_count", "<think>a</think><answer>1</answer>" + "x" * 100, {}, 0.9),
    ("xml_count", "<think><think>a</think>", {}, 0.25),
    ("xml_count", "plain text", {}, 0.0),
    ("keyword_match", "I love the Sun.", {"keywords": ["sun", "moon"]}, 0.5),
    ("keyword_match", "sun and moon", {"keywords": "sun, moon"}, 1.0),
    ("keyword_match", "sunny", {"keywords": ["sun"]}, 0.0),
    ("keyword_match", "anything", {"keywords": []}, 0.0),
    ("keyword_match", "hello there", {"fixed_keywords": ["hello"], "keywords": ["x"]}, 1.0),
]


def _batch(kwargs: dict[str, object]) -> dict[str, object]:
    # TRL passes one list per dataset column; `fixed_keywords` is bound once, not per row.
    return {k: (v if k == "fixed_keywords" else [v]) for k, v in kwargs.items()}


@pytest.mark.parametrize(("name", "completion", "kwargs", "expected"), CASES)
def test_reward_on_plain_completion(name: str, completion: str, kwargs: dict, expected: float):
    scores = BUILTIN_REWARDS[name](["prompt"], [completion], **_batch(kwargs))
    assert scores == pytest.approx([expected])


@pytest.mark.parametrize(("name", "completion", "kwargs", "expected"), CASES)
def test_reward_on_conversational_completion(
    name: str, completion: str, kwargs: dict, expected: float
):
    prompt = [{"role": "user", "content": "prompt"}]
    chat = [{"role": "assistant", "content": completion}]
    scores = BUILTIN_REWARDS[name]([prompt], [chat], **_batch(kwargs))
    assert scores == pytest.approx([expected])


def test_every_builtin_reward_has_cases():
    assert {case[0] for case in CASES} == set(BUILTIN_REWARDS)


def test_rewards_score_a_whole_batch_and_ignore_unknown_columns():
    scores = BUILTIN_REWARDS["correctness"](
        ["p1", "p2"],
        ["<answer>1</answer>", "<answer>3</answer>"],
        ground_truth=["1", "2"],
        answer=["x", "y"],
        trainer_state=None,
    )
    assert scores == [1.0, 0.0]


def test_content_parts_are_read_as_text():
    chat = [{"role": "assistant", "content": [{"type": "text", "text": "<answer>4</answer>"}]}]
    assert BUILTIN_REWARDS["correctness"](["p"], [chat], ground_truth=["4"]) == [1.0]


def test_required_columns_name_real_rewards():
    assert set(REQUIRED_COLUMNS) <= set(BUILTIN_REWARDS)


@pytest.mark.parametrize(
    "module",
    ["rewards._text", "rewards.answer", "rewards.format", "rewards.keywords", "training.progress"],
)
def test_doctests(module: str):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0
    assert result.failed == 0
