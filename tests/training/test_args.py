"""The command line: parsing, checks, and the exit code for bad arguments."""

from __future__ import annotations

import pytest

from training.args import ScriptArguments, build_parser, check_args, parse_args

BASE = ["--model", "m", "--dataset", "d.jsonl"]


def test_reward_functions_repeat_or_split_on_commas():
    args = parse_args([*BASE, "--reward_function", "a,b", "--reward_function", "c:d"])
    assert args.reward_function == ["a", "b", "c:d"]


def test_weights_and_keywords_take_spaces_or_commas():
    args = parse_args(
        [
            *BASE,
            "--reward_function",
            "a",
            "b",
            "--reward_weights",
            "1,0.5",
            "--keywords",
            "x",
            "y,z",
        ]
    )
    assert args.reward_weights == [1.0, 0.5]
    assert args.keywords == ["x", "y", "z"]


def test_boolean_flags_work_bare_or_with_a_value():
    args = parse_args([*BASE, "--reward_function", "a", "--use_vllm", "--use_unsloth", "false"])
    assert args.use_vllm is True
    assert args.use_unsloth is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reward_function", "a", "b", "--reward_weights", "1"], "has 1 values for 2 reward"),
        (["--reward_function", "a", "--reward_weights", "heavy"], "expected numbers"),
        (["--reward_function", "a", "--num_generations", "1"], "--num_generations must be"),
        (["--reward_function", "a", "--max_steps", "0"], "--max_steps must be at least 1"),
        (
            ["--reward_function", "a", "--per_device_train_batch_size", "0"],
            "--per_device_train_batch_size must be at least 1",
        ),
        (
            ["--reward_function", "a", "--gradient_accumulation_steps", "0"],
            "--gradient_accumulation_steps must be at least 1",
        ),
        (
            ["--reward_function", "a", "--max_completion_length", "0"],
            "--max_completion_length must be at least 1",
        ),
        (["--reward_function", "a", "--logging_steps", "0"], "--logging_steps must be at least 1"),
        (["--reward_function", "a", "--lora_r", "-1"], "--lora_r must be at least 0"),
        (["--reward_function", "a", "--preprocess", "fancy"], "invalid choice"),
        (["--reward_function", "a", "--max_steps", "ten"], "invalid int value"),
        ([], "--reward_function"),
    ],
)
def test_bad_arguments_exit_64_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, *argv])
    assert exit_info.value.code == 64
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1


def test_every_field_has_help_and_a_flag():
    help_text = build_parser().format_help()
    for name, f in ScriptArguments.__dataclass_fields__.items():
        if f.metadata.get("cli", True):
            assert f"--{name}" in help_text
            assert f.metadata["help"]


def test_check_args_accepts_sensible_arguments():
    args = ScriptArguments(model="m", dataset="d", reward_function=["a"], reward_weights=[2.0])
    assert check_args(args) is None
