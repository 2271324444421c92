"""Bad input is exit 2 and one line, always; success is silent on stderr. The real CLI,
as a subprocess and in-process with arbitrary argv, against real Postgres and NATS."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scheduler.cli import cli
from scheduler.cli._common import run_guarded
from scheduler.embedded import EmbeddedNats
from tests.acceptance.test_cli import snapshot

SUBMIT = ["job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "r"]


def rlfleet(env: dict[str, str], *args: str | bytes) -> subprocess.CompletedProcess[str]:
    """`rlfleet ARGS…` as a user runs it (bytes arguments reach argv as they are)."""
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=60,
    )


@pytest.fixture
def env(database_url: str, nats: EmbeddedNats) -> dict[str, str]:
    """The environment of a user: no log level set."""
    base = {k: v for k, v in os.environ.items() if k != "RLFLEET_LOG_LEVEL"}
    return {**base, "RLFLEET_DATABASE_URL": database_url, "RLFLEET_NATS_URL": nats.url}


def sql(database_url: str, statement: str) -> None:
    """Run one statement on the test's database."""
    url = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)  # type: ignore[arg-type]


def add_polled_vm(env: dict[str, str], name: str, gpus: int) -> None:
    """A VM as the poller leaves it after its first poll: healthy, with `gpus` GPU rows."""
    assert rlfleet(env, "vm", "add", name, "--host", "10.0.0.9").returncode == 0
    sql(
        env["RLFLEET_DATABASE_URL"],
        f"UPDATE vms SET status = 'healthy', last_seen_at = now() WHERE name = '{name}';"
        f"INSERT INTO gpus (vm_id, index, uuid) SELECT id, i, 'GPU-{name}-' || i "
        f"FROM vms, generate_series(0, {gpus - 1}) i WHERE name = '{name}'",
    )


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    """Exit `code`, exactly one line on stderr saying `text`, no traceback."""
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and text in lines[0], result.stderr


BIG = str(2**63)
BAD_INPUT: list[tuple[list[str | bytes], str]] = [
    (["vm", "add", "v", "--host", "h" * 256], "too long (256 characters, at most 255)"),
    (["vm", "add", "v", "--host", "h", "--user", "u" * 65], "at most 64"),
    (["vm", "add", "v" * 129, "--host", "h"], "too long"),
    (["vm", "show", "v" * 5000], "too long"),
    (["vm", "add", "v", "--host", "h", "--port", BIG], "between 1 and 65535"),
    ([*SUBMIT, "--gpus", "2147483648"], "2147483648"),
    ([*SUBMIT, "--gpus", "1025"], "and 1024, not 1025"),
    ([*SUBMIT, "--priority", BIG], "between -2147483648 and 2147483647"),
    ([*SUBMIT, "--max-retries", "1001"], "and 1000, not 1001"),
    ([*SUBMIT, "--name", "n" * 256], "at most 255"),
    ([*SUBMIT, "--model", "m" * 5000], "at most 4096"),
    (["job", "show", BIG], "between 1 and 9223372036854775807"),
    (["job", "cancel", BIG], "between 1 and 9223372036854775807"),
    (["job", "logs", "1", "--attempt", "2147483648"], "between 1 and 2147483647"),
    (["job", "list", "--limit", BIG], "between 1 and 9223372036854775807"),
    (["job", "cancel", "1", "--grace", "nan"], "between 0 and 86400"),
    (["vm", "add", b"v\xff", "--host", "h"], "is not valid UTF-8"),
    ([*SUBMIT, "--", b"--max_steps=\xc3("], "is not valid UTF-8"),
    (["--database-url", "postgresql://u:p@h:notaport/db", "job", "list"], "is malformed"),
    (["--database-url", "not a url", "vm", "list"], "is malformed"),
    (["--database-url", "mysql://u@h/db", "vm", "list"], "must name a PostgreSQL database"),
    (["--database-url", "postgresql+asyncpg://u@h/db", "db", "current"], "psycopg driver"),
    (["--nats-url", "nats://h:99999", *SUBMIT], "the NATS URL"),
    (["db", "upgrade", "--revision", "nope"], "cannot upgrade to 'nope'"),
    (["job", "show", "1\n2"], "'1\\n2' is not a valid integer"),
    ([*SUBMIT, "--", "--output_dir", "/x"], "use `job submit --output-dir`"),
    ([*SUBMIT, "--", "--output_dir=/x"], "use `job submit --output-dir`"),
    ([*SUBMIT, "--", "--output=/x"], "use `job submit --output-dir`"),
    ([*SUBMIT, "--", "--resume", "auto"], "--resume auto"),
    ([*SUBMIT, "--", "--model", "x"], "use `job submit --model`"),
    ([*SUBMIT, "--", "--dataset=x"], "use `job submit --dataset`"),
    ([*SUBMIT, "--", "--reward_function", "x"], "use `job submit --reward-function`"),
    (["vm", "drain", "ghost", "--gpu", "0"], "no VM named 'ghost'"),
    (["vm", "undrain", "ghost", "--gpu", "g" * 200], "too long"),
]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
@pytest.mark.slow
def test_bad_input_is_exit_2_one_line_and_changes_nothing(
    env: dict[str, str], args: list[str | bytes], message: str
) -> None:
    before = snapshot(env["RLFLEET_DATABASE_URL"])
    result = rlfleet(env, *args)
    assert_one_line(result, 2, message)
    assert "notaport" not in result.stderr and ":p@" not in result.stderr
    assert snapshot(env["RLFLEET_DATABASE_URL"]) == before


@pytest.mark.slow
def test_a_malformed_database_url_from_the_environment_is_exit_2(env: dict[str, str]) -> None:
    env = {**env, "RLFLEET_DATABASE_URL": "postgresql://me:secret@[::1/x"}
    for args in (["job", "list"], ["db", "upgrade"], ["dispatcher"]):
        result = rlfleet(env, *args)
        assert_one_line(result, 2, "the database URL")
        assert "secret" not in result.stderr


@pytest.mark.slow
def test_successful_commands_print_nothing_on_stderr(env: dict[str, str]) -> None:
    """Given no --log-level, a command that succeeds writes nothing on stderr; with
    `--log-level debug` its log lines are there."""
    add_polled_vm(env, "gpu-0", 1)
    commands: list[list[str]] = [
        ["vm", "add", "gpu-1", "--host", "10.0.0.5"],
        ["vm", "list", "--json"],
        ["vm", "show", "gpu-1"],
        ["vm", "drain", "gpu-1"],
        [*SUBMIT, "--output-dir", "runs/first", "--", "--max_steps", "5"],
        ["job", "list"],
        ["job", "show", "1", "--json"],
        ["job", "cancel", "1"],
        ["db", "current"],
        ["vm", "remove", "gpu-1"],
    ]
    for args in commands:
        result = rlfleet(env, *args)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stderr == "", (args, result.stderr)
    assert rlfleet(env, *SUBMIT).stdout.strip() == "2"
    debug = rlfleet(env, "--log-level", "debug", "job", "cancel", "2")
    assert debug.returncode == 0
    assert '"event": "job_cancelled"' in debug.stderr


@pytest.mark.slow
def test_output_dir_is_stored_and_shown(env: dict[str, str]) -> None:
    add_polled_vm(env, "gpu-1", 1)
    submitted = rlfleet(env, *SUBMIT, "--output-dir", "/data/run 1", "--json")
    assert submitted.returncode == 0 and submitted.stderr == "", submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    shown = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert shown["output_dir"] == "/data/run 1"


@pytest.mark.slow
def test_a_job_no_polled_vm_can_run_is_refused(env: dict[str, str]) -> None:
    """Given a polled fleet whose largest VM has 2 GPUs, `--gpus 9` is exit 2 and one line
    and nothing is inserted; `--gpus 2` is accepted."""
    add_polled_vm(env, "small", 1)
    add_polled_vm(env, "medium", 2)
    before = snapshot(env["RLFLEET_DATABASE_URL"])
    assert_one_line(rlfleet(env, *SUBMIT, "--gpus", "9"), 2, "no VM has 9 GPUs (the largest has 2)")
    assert snapshot(env["RLFLEET_DATABASE_URL"]) == before
    accepted = rlfleet(env, *SUBMIT, "--gpus", "2")
    assert accepted.returncode == 0 and accepted.stderr == "", accepted.stderr


@pytest.mark.slow
def test_before_any_poll_a_big_job_is_accepted_with_a_warning(env: dict[str, str]) -> None:
    """A fresh installation submits before its VMs are polled: the job is accepted (exit 0)
    and one warning line says its size could not be checked."""
    fresh = rlfleet(env, *SUBMIT, "--gpus", "9")
    assert fresh.returncode == 0 and fresh.stdout.strip().isdigit()
    assert fresh.stderr.splitlines() == [
        "Warning: no VM is registered yet, so nobody knows whether 9 GPUs will fit"
    ]
    add_polled_vm(env, "polled", 2)
    assert rlfleet(env, "vm", "add", "new", "--host", "10.0.0.7").returncode == 0
    unpolled = rlfleet(env, *SUBMIT, "--gpus", "9")
    assert unpolled.returncode == 0
    assert len(unpolled.stderr.splitlines()) == 1
    assert "VM(s) new have not been polled yet" in unpolled.stderr


# -- arbitrary argv ---------------------------------------------------------------------

COMMANDS = [
    ["vm", "add"],
    ["vm", "list"],
    ["vm", "show"],
    ["vm", "remove"],
    ["vm", "drain"],
    ["vm", "undrain"],
    ["job", "submit"],
    ["job", "list"],
    ["job", "show"],
    ["job", "cancel"],
    ["job", "retry"],
    ["job", "logs"],
    ["db", "current"],
    ["db", "upgrade"],
    ["job"],
    ["vm"],
    [],
]
OPTIONS = [
    "--host", "--port", "--user", "--transport", "--python", "--entrypoint", "--json",
    "--model", "--dataset", "--reward-function", "--gpus", "--max-retries", "--priority",
    "--name", "--output-dir", "--status", "--limit", "--attempt", "--grace", "--revision",
    "--no-progress", "--force", "--help", "--", "--log-level", "--database-url", "--gpu",
]  # fmt: skip
DAEMONS = {"poller", "dispatcher", "requeue", "up"}

undecodable = st.binary(min_size=1, max_size=12).map(
    lambda b: b.decode("utf-8", errors="surrogateescape")
)
value = st.one_of(
    st.integers().map(str),
    st.sampled_from(["1", "0", "-1", str(2**31), str(2**63), "nan", "inf", "1e400", "head"]),
    st.text(max_size=20),
    st.text(min_size=200, max_size=400),
    undecodable,
    st.sampled_from(["--output_dir=x", "--resume", "queued", "ssh", "local", "gpu-1", "m"]),
)
# An option followed by a value most of the time, so that values reach the commands.
word = st.one_of(
    st.tuples(st.sampled_from(OPTIONS), value).map(list),
    st.one_of(st.sampled_from(OPTIONS), value).map(lambda w: [w]),
)


@contextlib.contextmanager
def captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """stdout and stderr as a terminal-less user gets them (UTF-8, strict stdout)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace")
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err  # type: ignore[misc]
    finally:
        sys.stdout, sys.stderr = old


def _read(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", errors="replace")  # type: ignore[attr-defined]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    command=st.sampled_from(COMMANDS),
    words=st.lists(word, max_size=6).map(lambda ws: [w for pair in ws for w in pair]),
)
@pytest.mark.slow
def test_arbitrary_argv_is_exit_0_1_or_2_with_at_most_one_error_line(
    database_url: str,
    nats: EmbeddedNats,
    command: list[str],
    words: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the argv, the CLI ends with 0, 1 or 2; a failure says so in one line on
    stderr; nothing escapes as a traceback (an exception out of `run_guarded`)."""
    assume(not DAEMONS & set(words))
    monkeypatch.setenv("RLFLEET_DATABASE_URL", database_url)
    monkeypatch.setenv("RLFLEET_NATS_URL", nats.url)
    monkeypatch.delenv("RLFLEET_LOG_LEVEL", raising=False)
    with captured() as (out, err):
        code = run_guarded(cli, [*command, *words])
    stderr = _read(err)  # type: ignore[arg-type]
    _read(out)  # type: ignore[arg-type]
    assert code in (0, 1, 2), (code, stderr)
    assert "Traceback" not in stderr
    if code != 0:
        assert len(stderr.splitlines()) <= 1, stderr


def test_job_ids_are_ascii_digits_only(env: dict[str, str]) -> None:
    # Given job 4 exists
    for _ in range(4):
        assert rlfleet(env, *SUBMIT).returncode == 0
    assert rlfleet(env, "job", "show", "4", "--no-progress").returncode == 0
    # Then an Arabic-Indic four, a superscript two or digits in disguise are no job id
    for raw in ("٤", "²", "4²", "0x4", "4_0", "+4", "9" * 30):
        shown = rlfleet(env, "job", "show", raw, "--no-progress")
        assert shown.returncode == 2, (raw, shown.stdout, shown.stderr)
        assert len(shown.stderr.strip().splitlines()) == 1, (raw, shown.stderr)
    # And another integer flag refuses non-ASCII digits as well
    assert rlfleet(env, *SUBMIT, "--gpus", "١").returncode == 2


def test_control_and_bidi_characters_a_user_typed_are_shown_escaped(env: dict[str, str]) -> None:
    # Given a job and a VM whose names hold ESC, CR and a right-to-left override
    name = "ok\x1b[31mred\rX\u202eevil"
    assert rlfleet(env, *SUBMIT, "--name", name).returncode == 0
    sql(env["RLFLEET_DATABASE_URL"], "INSERT INTO vms (name, host) VALUES (E'v\\x1b[2J', 'h')")
    # When they are listed and shown, then no such character reaches the terminal, and the
    # name reads escaped
    for args in (("job", "list"), ("job", "show", "1", "--no-progress"), ("vm", "list")):
        out = rlfleet(env, *args)
        assert out.returncode == 0, (args, out.stderr)
        assert not {"\x1b", "\r", "\u202e"} & set(out.stdout), (args, out.stdout)
    assert "ok\\x1b[31mred\\rX\\u202eevil" in rlfleet(env, "job", "list").stdout
    # And --json keeps the exact name
    listed = json.loads(rlfleet(env, "job", "list", "--json").stdout)
    assert listed[0]["name"] == name


def test_job_show_says_how_often_a_waiting_move_repeated(env: dict[str, str]) -> None:
    # Given a job whose wake-up event was counted 5 times
    assert rlfleet(env, *SUBMIT).returncode == 0
    sql(
        env["RLFLEET_DATABASE_URL"],
        "INSERT INTO job_events (job_id, from_status, to_status, reason, actor, count, last_at)"
        " VALUES (1, 'pending', 'queued', 'looking again', 'requeue', 5, now())",
    )
    # Then `job show` says so next to the reason, and --json has the count and the time
    shown = rlfleet(env, "job", "show", "1", "--no-progress").stdout
    assert re.search(r"looking again \(×5, last at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\)", shown), shown
    events = json.loads(rlfleet(env, "job", "show", "1", "--json", "--no-progress").stdout)
    assert [(e["count"], bool(e["last_at"])) for e in events["events"]] == [(1, False), (5, True)]
