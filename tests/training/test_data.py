"""Dataset loading and the generic / deepseek prompt construction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset

from training.data import R1_SYSTEM_PROMPT, check_columns, load_raw_dataset, preprocess
from training.errors import UsageError

ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "Cost?", "answer": "It is\n#### $1,250"},
]


def test_generic_plain_text_prompt_and_ground_truth_after_hashes():
    out = preprocess(Dataset.from_list(ROWS), "generic", conversational=False)
    assert out["prompt"] == ["What is 2 + 3?", "Cost?"]
    assert out["ground_truth"] == ["5", "1250"]


def test_generic_conversational_prompt():
    out = preprocess(Dataset.from_list(ROWS), "generic", conversational=True)
    assert out[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]


def test_deepseek_adds_the_r1_system_prompt():
    chat = preprocess(Dataset.from_list(ROWS), "deepseek", conversational=True)[0]["prompt"]
    assert chat[0] == {"role": "system", "content": R1_SYSTEM_PROMPT}
    assert chat[1]["content"] == "What is 2 + 3?"
    text = preprocess(Dataset.from_list(ROWS), "deepseek", conversational=False)[0]["prompt"]
    assert text.startswith(R1_SYSTEM_PROMPT) and text.endswith("User: What is 2 + 3? Assistant:")


def test_a_prompt_column_wins_and_other_columns_are_kept():
    data = Dataset.from_list([{"prompt": "Say hi", "question": "ignored", "keywords": ["hi"]}])
    out = preprocess(data, "generic", conversational=False)
    assert out[0]["prompt"] == "Say hi"
    assert out[0]["keywords"] == ["hi"]
    assert "ground_truth" not in out.column_names


def test_missing_prompt_column_is_a_usage_error():
    with pytest.raises(UsageError, match="no 'prompt' or 'question' column"):
        preprocess(Dataset.from_list([{"text": "x"}]), "generic", conversational=False)


def test_rewards_needing_a_missing_column_are_refused():
    data = Dataset.from_list([{"prompt": "x"}])
    with pytest.raises(UsageError, match="correctness needs a 'ground_truth' column"):
        check_columns(data, {"correctness": "ground_truth"})


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_load_by_suffix(tmp_path: Path, suffix: str):
    path = tmp_path / f"data{suffix}"
    source = Dataset.from_list(ROWS)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        source.to_csv(str(path), index=False)
    else:
        source.to_parquet(str(path))
    loaded = load_raw_dataset(str(path), "train")
    assert loaded["question"] == [row["question"] for row in ROWS]


def test_unreadable_and_missing_files_are_usage_errors(tmp_path: Path):
    with pytest.raises(UsageError, match="dataset file not found"):
        load_raw_dataset(str(tmp_path / "missing.jsonl"), "train")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "unterminated\n')
    with pytest.raises(UsageError, match="cannot read dataset"):
        load_raw_dataset(str(broken), "train")
