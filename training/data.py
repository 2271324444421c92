"""Load the training dataset and turn its rows into GRPO prompts (plus `ground_truth`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewards._text import ground_truth_from_answer
from training.errors import TransientError, UsageError, is_network_timeout, one_line

if TYPE_CHECKING:
    from datasets import Dataset

R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
    "process here </think> <answer> answer here </answer>."
)

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
PROMPT_COLUMNS = ("prompt", "question")


def _reason(exc: BaseException) -> str:
    # "An error occurred while generating the dataset" names no cause; the one it wraps does,
    # and with datasets' own log line silenced it would otherwise be lost.
    text = one_line(exc)
    if type(exc).__name__ == "DatasetGenerationError" and exc.__cause__ is not None:
        text = f"{text}: {one_line(exc.__cause__)}"
    return text


def load_raw_dataset(name: str, split: str, config: str | None = None) -> Dataset:
    """Load a local file (by suffix) or a hub dataset; unusable input raises UsageError."""
    from datasets import load_dataset

    path = Path(name)
    builder = LOCAL_FORMATS.get(path.suffix.lower())
    if builder is not None and not path.is_file():
        raise UsageError(f"dataset file not found: {name}")
    try:
        if builder is not None:
            return load_dataset(builder, data_files={"train": str(path)}, split=split)
        return load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; sort them by cause
        if is_network_timeout(exc):
            raise TransientError(f"downloading dataset {name} failed: {one_line(exc)}") from exc
        raise UsageError(f"cannot read dataset {name}: {_reason(exc)}") from exc


def load_mixture(mixture: dict[str, Any], split: str) -> Dataset:
    """`split` of a TRL dataset mixture (the `datasets`, `streaming` and `test_split_size`
    keys of a recipe), loaded by TRL's get_dataset as `trl grpo` loads it."""
    from trl import DatasetMixtureConfig, get_dataset
    from trl.scripts.utils import DatasetConfig

    try:
        entries = [DatasetConfig(**entry) for entry in mixture["datasets"]]
        config = DatasetMixtureConfig(**{**mixture, "datasets": entries})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"datasets: {one_line(exc)}") from exc
    try:
        loaded = get_dataset(config)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; sort them by cause
        if is_network_timeout(exc):
            raise TransientError(f"downloading datasets failed: {one_line(exc)}") from exc
        raise UsageError(f"cannot read datasets: {_reason(exc)}") from exc
    if split not in loaded:
        raise UsageError(f"datasets: no split {split!r} (splits: {', '.join(loaded)})")
    return loaded[split]


def prompt_column(columns: list[str]) -> str:
    """The column the prompt comes from: `prompt`, else `question`."""
    for column in PROMPT_COLUMNS:
        if column in columns:
            return column
    raise UsageError(
        f"dataset has no 'prompt' or 'question' column (columns: {', '.join(columns)})"
    )


def build_prompt(text: Any, mode: str, conversational: bool) -> Any:
    """One prompt in the form GRPOTrainer takes: a list of messages, or plain text."""
    if isinstance(text, list):  # Already conversational: only the system prompt may be added.
        if mode == "deepseek" and not any(m.get("role") == "system" for m in text):
            return [{"role": "system", "content": R1_SYSTEM_PROMPT}, *text]
        return text
    if conversational:
        messages = [{"role": "user", "content": str(text)}]
        if mode == "deepseek":
            messages.insert(0, {"role": "system", "content": R1_SYSTEM_PROMPT})
        return messages
    if mode == "deepseek":
        return f"{R1_SYSTEM_PROMPT} User: {text} Assistant:"
    return str(text)


def preprocess(dataset: Dataset, mode: str, conversational: bool) -> Dataset:
    """Rename/format rows for GRPO: `prompt` from prompt/question, `ground_truth` from answer."""
    source = prompt_column(list(dataset.column_names))
    has_answer = "answer" in dataset.column_names and "ground_truth" not in dataset.column_names

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        out = {"prompt": build_prompt(row[source], mode, conversational)}
        if has_answer:
            out["ground_truth"] = ground_truth_from_answer(str(row["answer"]))
        return out

    return dataset.map(convert, desc="Building prompts")


def check_columns(dataset: Dataset, required: dict[str, str]) -> None:
    """Fail with UsageError when a reward needs a column the dataset lacks."""
    for reward, column in required.items():
        if column not in dataset.column_names:
            hint = " (an 'answer' column provides it)" if column == "ground_truth" else ""
            raise UsageError(
                f"reward {reward} needs a {column!r} column{hint}; the dataset has none"
            )
