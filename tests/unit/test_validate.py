"""The limits every value is checked against, read from the schema's columns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler.errors import BadInput
from scheduler.models import VM, Job, JobNode
from scheduler.rowcheck import job_row_problem
from scheduler.validate import (
    INT4,
    INT8,
    JOB_NAME_MAX,
    MAX_JSON_DEPTH,
    TEXT_MAX,
    UnreadableJson,
    bounded_json_loads,
    check_database_url,
    check_int,
    check_text,
    int_range,
    max_length,
    parse_database_url,
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


def test_the_limits_the_command_line_uses_are_the_columns() -> None:
    """`job submit`, `job list` and the job commands check values against constants, not
    columns (they do not load SQLAlchemy): each constant is what its column holds."""
    assert max_length(Job.name) == JOB_NAME_MAX
    for column in (Job.model, Job.dataset, Job.reward_function, Job.output_dir):
        assert max_length(column) == TEXT_MAX
    for column in (Job.gpus_requested, Job.nodes, Job.max_retries, Job.priority, Job.attempt):
        assert int_range(column) == INT4
    assert int_range(JobNode.rank) == INT4
    assert int_range(Job.id) == INT8


URLS = [
    "postgresql+psycopg://u:p%40w@h:5432/db?host=/tmp&sslmode=require",
    "postgresql+psycopg://h/d",
    "postgresql+psycopg:///d",
    "postgresql+psycopg://[::1]:5/d",
    "postgresql+psycopg://a:b:c@h/d%20b",
    "postgresql+psycopg_async://u@h/",
    "postgresql+psycopg://u@h: 5/d",
    "postgresql://u@h/d",
    "mysql://u@h/d",
    "postgresql+psycopg://u@h:/d",
    "postgresql+psycopg://u:pw@h:port/db",
    "nope",
    "postgresql+psycopg:/h/d",
]


@pytest.mark.parametrize("url", URLS)
def test_database_urls_are_read_as_sqlalchemy_reads_them(url: str) -> None:
    """The command line parses the URL without SQLAlchemy: it must read the same parts (and
    refuse the same URLs) as `make_url`, which the daemons use."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        theirs = make_url(url)
        expected: object = (
            theirs.get_backend_name(),
            theirs.username,
            theirs.password,
            theirs.host,
            theirs.port,
            theirs.database or None,
            dict(theirs.query),
        )
    except (ArgumentError, ValueError):
        expected = "refused"
    try:
        ours = parse_database_url(url)
        found: object = (
            ours.backend,
            ours.user,
            ours.password,
            ours.host,
            ours.port,
            ours.database,
            ours.query,
        )
    except ValueError:
        found = "refused"
    assert found == expected


@pytest.mark.parametrize("url", [u for u in URLS if u.startswith("postgresql+psycopg")][:6])
def test_the_command_line_connects_as_sqlalchemy_would(url: str) -> None:
    """`job list` and `job submit` connect with the arguments SQLAlchemy's psycopg dialect
    gives psycopg for the same URL (and the daemons' connect timeout)."""
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
    from sqlalchemy.engine import make_url

    from scheduler.pgconn import CONNECT_TIMEOUT_S, connect_kwargs

    _, theirs = PGDialect_psycopg().create_connect_args(make_url(url))
    assert connect_kwargs(url) == {**theirs, "connect_timeout": CONNECT_TIMEOUT_S}


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
        # TRL's spellings, which train_grpo.py accepts too, and a recipe of its own.
        ("--model_name_or_path", "--model_name_or_path"),
        ("--dataset-name=d", "--dataset-name"),
        ("--reward_funcs", "--reward_funcs"),
        ("--resume_from_checkpoint", "--resume_from_checkpoint"),
        ("--config=r.yaml", "--config"),
        ("--dataset_config", None),
        ("--model_revision", None),
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
        ({"gpus_requested": 0}, "gpus_requested must be between 1 and 65536"),
        ({"gpus_requested": 10**9}, "gpus_requested must be between 1 and 65536"),
        # Every GPU of the attempt: the same on each VM of a training job, 1024 at most.
        ({"gpus_requested": 2048, "nodes": 2}, None),
        ({"gpus_requested": 3, "nodes": 2}, "not the same GPUs on each of 2 VMs"),
        ({"gpus_requested": 1025}, "is more than 1024 GPUs on a VM"),
        ({"reward_function": "a,,b"}, "empty name"),
        ({"model": ""}, "model is empty"),
        ({"attempt": 2**31 - 1}, "attempt must be between 0 and 2147483646, not 2147483647"),
        ({"attempt": -1}, "attempt must be between 0 and"),
        ({"retry_count": 2**31 - 1}, "retry_count must be between 0 and 2147483646"),
        ({"machine_faults": 2**31 - 1}, "machine_faults must be between 0 and 2147483646"),
        ({"max_retries": 1001}, "max_retries must be between 0 and 1000"),
        ({"nodes": 0}, "nodes must be between 1 and 64"),
        ({"attempt": 2**31 - 2, "retry_count": 1000, "max_retries": 1000}, None),
        ({"env": {"HF_TOKEN": "x"}}, None),
        ({"env": 5}, "env must be a JSON object of strings, not a JSON number"),
        ({"env": ["HF_TOKEN"]}, "env must be a JSON object of strings, not a JSON array"),
        ({"env": {"A": 5}}, "env A: the value is not a string"),
        ({"env": {"A": "x\ny"}}, "env A: the value must be one line"),
        ({"env": {"RLFLEET_JOB_ID": "1"}}, "env: RLFLEET_JOB_ID is set by the scheduler"),
        ({"env": {"A B": "x"}}, "is not a variable name"),
        ({"env": UnreadableJson("JSON nested deeper than 64 levels", "object")}, "env: JSON"),
        ({"extra_args": UnreadableJson("JSON nested deeper than 64 levels", "array")}, "deeper"),
        ({"roles": UnreadableJson("JSON nested deeper than 64 levels", "object")}, "roles: JSON"),
        ({"roles": {"roles": []}}, "roles: roles: must be a mapping"),
        ({"workdir_digest": "0" * 64}, None),
        ({"workdir_digest": "../" + "0" * 61}, "workdir_digest is not a sha256 digest"),
        ({"workdir_digest": "0" * 64 + "\n"}, "workdir_digest is not a sha256 digest"),
        ({"workdir_digest": 5}, "workdir_digest is not a sha256 digest"),
    ],
)
def test_job_rows_the_launch_cannot_use(fields: dict[str, object], problem: str | None) -> None:
    found = job_row_problem(_row(**fields))
    assert found == problem if problem is None else (found is not None and problem in found)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"a": [1, "]]]]", {"b": null}]}', {"a": [1, "]]]]", {"b": None}]}),
        ('"[[[[[[[["', "[[[[[[[["),
        (b'["x"]', ["x"]),
        (
            "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH,
            eval("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH),
        ),
        ('{"s": "\\"[[[[\\""}', {"s": '"[[[["'}),
    ],
)
def test_json_from_the_database_within_bounds_decodes_as_json_does(
    text: str, value: object
) -> None:
    assert bounded_json_loads(text) == value


@pytest.mark.parametrize(
    ("text", "kind", "problem"),
    [
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "array", "nested deeper than 64"),
        ('{"roles": ' + "[" * 3000 + "]" * 3000 + "}", "object", "nested deeper than 64"),
        ("[" * 100_000, "array", "nested deeper than 64"),
        ("[" + "9" * 5000 + "]", "array", "cannot be read"),
        (" 1" + "0" * 5000, "number", "cannot be read"),
    ],
)
def test_json_from_the_database_beyond_bounds_is_unreadable_never_an_error(
    text: str, kind: str, problem: str
) -> None:
    """A JSON column value too deep (Python's decoder recurses), or with a number past the
    int digit limit, reads as an `UnreadableJson`: its row is refused, nothing raises."""
    value = bounded_json_loads(text)
    assert isinstance(value, UnreadableJson)
    assert value.kind == kind and problem in value.problem
