"""The limits every value is checked against, read from the schema's columns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler.errors import BadInput
from scheduler.models import VM, Job
from scheduler.validate import (
    check_database_url,
    check_int,
    check_text,
    int_range,
    job_row_problem,
    max_length,
    reserved_flag,
)


def test_limits_come_from_the_column_types() -> None:
    assert int_range(Job.id) == (-(2**63), 2**63 - 1)
    assert int_range(Job.priority) == (-(2**31), 2**31 - 1)
    assert max_length(VM.host) == 255 and max_length(VM.user) == 64
    assert max_length(Job.model) == 4096  # unbounded text: a sane limit


@pytest.mark.parametrize(
    ("value", "message"),
    [("h" * 256, "too long"), ("a\udcffb", "not valid UTF-8"), ("a\x00", "NUL"), (" ", "empty")],
)
def test_text_that_no_row_can_hold_is_refused(value: str, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        check_text(value, "--host", column=VM.host)


def test_integers_beyond_the_column_are_refused() -> None:
    assert check_int(2**31 - 1, "--priority", column=Job.priority) == 2**31 - 1
    with pytest.raises(BadInput, match="between -2147483648 and 2147483647"):
        check_int(2**31, "--priority", column=Job.priority)


@pytest.mark.parametrize(
    "url", ["nope", "postgresql://u:pw@h:port/db", "mysql://u@h/d", "postgresql+asyncpg://h/d"]
)
def test_a_malformed_database_url_is_bad_input_without_the_url(url: str) -> None:
    with pytest.raises(BadInput) as caught:
        check_database_url(url)
    assert "pw" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("arg", "flag"),
    [
        ("--output_dir", "--output_dir"),
        ("--output_dir=/x", "--output_dir"),
        ("--out", "--output_dir"),
        ("--resume=auto", "--resume"),
        ("--max_steps", None),
        ("--", None),
        ("output_dir", None),
    ],
)
def test_flags_rlfleet_sets_itself_are_recognised(arg: str, flag: str | None) -> None:
    assert reserved_flag(arg) == flag


def _row(**fields: object) -> SimpleNamespace:
    base = {"gpus_requested": 1, "model": "m", "dataset": "d", "reward_function": "r"}
    return SimpleNamespace(**{**base, "extra_args": [], **fields})


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({}, None),
        ({"extra_args": ["--max_steps", "5"]}, None),
        ({"extra_args": {"a": 1}}, "not a JSON object"),
        ({"extra_args": None}, "not a JSON null"),
        ({"extra_args": ["--x", 5]}, "argument 5 after -- is not a string"),
        ({"gpus_requested": 0}, "gpus_requested must be between 1 and 1024"),
        ({"gpus_requested": 10**9}, "gpus_requested must be between 1 and 1024"),
        ({"reward_function": "a,,b"}, "empty name"),
        ({"model": ""}, "model is empty"),
    ],
)
def test_job_rows_the_launch_cannot_use(fields: dict[str, object], problem: str | None) -> None:
    found = job_row_problem(_row(**fields))
    assert found == problem if problem is None else (found is not None and problem in found)
