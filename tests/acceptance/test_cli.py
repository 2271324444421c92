"""The real `rlfleet` CLI as a subprocess, against real Postgres and NATS."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from scheduler.embedded import EmbeddedNats, free_port

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow


def rlfleet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def env(database_url: str, nats: EmbeddedNats) -> dict[str, str]:
    return {
        **os.environ,
        "RLFLEET_DATABASE_URL": database_url,
        "RLFLEET_NATS_URL": nats.url,
        "RLFLEET_LOG_LEVEL": "WARNING",
    }


def snapshot(database_url: str) -> list[tuple[object, ...]]:
    """Every row of the tables a command could change."""
    url = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        return [
            row
            for table in ("vms", "gpus", "jobs", "job_events")
            for row in conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
        ]


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and text in lines[0], result.stderr


def test_vm_lifecycle(env: dict[str, str]) -> None:
    added = rlfleet(env, "vm", "add", "gpu-1", "--host", "10.0.0.5", "--user", "ubuntu")
    assert added.returncode == 0, added.stderr
    listed = json.loads(rlfleet(env, "vm", "list", "--json").stdout)
    assert [(v["name"], v["host"], v["port"], v["status"]) for v in listed] == [
        ("gpu-1", "10.0.0.5", 22, "unknown")
    ]
    assert rlfleet(env, "vm", "drain", "gpu-1").returncode == 0
    assert json.loads(rlfleet(env, "vm", "show", "gpu-1", "--json").stdout)["draining"] is True
    assert rlfleet(env, "vm", "undrain", "gpu-1").returncode == 0
    assert json.loads(rlfleet(env, "vm", "show", "gpu-1", "--json").stdout)["draining"] is False
    assert "gpu-1" in rlfleet(env, "vm", "list").stdout
    assert rlfleet(env, "vm", "remove", "gpu-1").returncode == 0
    assert json.loads(rlfleet(env, "vm", "list", "--json").stdout) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["vm", "add", "dup", "--host", "h2"], "already exists"),
        (["vm", "add", "p0", "--host", "h", "--port", "0"], "between 1 and 65535"),
        (["vm", "add", "p1", "--host", "h", "--port", "65536"], "between 1 and 65535"),
        (["vm", "add", "e", "--host", ""], "--host must not be empty"),
        (["vm", "add", "k", "--host", "h", "--ssh-key", "/no/such/key"], "does not exist"),
        (["vm", "add", "bad name", "--host", "h"], "invalid VM name"),
        (["vm", "show", "ghost"], "no VM named 'ghost'"),
        (["vm", "remove", "ghost"], "no VM named 'ghost'"),
        (
            [
                "job",
                "submit",
                "--model",
                "m",
                "--dataset",
                "d",
                "--reward-function",
                "r",
                "--gpus",
                "0",
            ],
            "--gpus must be at least 1",
        ),
        (
            [
                "job",
                "submit",
                "--model",
                "m",
                "--dataset",
                "d",
                "--reward-function",
                "r",
                "--max-retries",
                "-1",
            ],
            "--max-retries must not be negative",
        ),
        (["job", "submit", "--dataset", "d", "--reward-function", "r"], "--model"),
        (["job", "show", "424242"], "no job with id 424242"),
        (["job", "show", "abc"], "is not a valid integer"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    env: dict[str, str], args: list[str], message: str
) -> None:
    assert rlfleet(env, "vm", "add", "dup", "--host", "h1").returncode == 0
    before = snapshot(env["RLFLEET_DATABASE_URL"])

    assert_one_line_error(rlfleet(env, *args), 2, message)

    assert snapshot(env["RLFLEET_DATABASE_URL"]) == before


def test_unreachable_database_is_one_line_exit_1_without_the_password(env: dict[str, str]) -> None:
    env = {**env, "RLFLEET_DATABASE_URL": f"postgresql://me:hunter2@127.0.0.1:{free_port()}/x"}
    result = rlfleet(env, "job", "list")
    assert_one_line_error(result, 1, "cannot reach the database")
    assert "hunter2" not in result.stderr + result.stdout
    assert_one_line_error(rlfleet(env, "db", "upgrade"), 1, "cannot reach the database")


def test_submit_publishes_the_printed_id_to_a_plain_subscriber(
    env: dict[str, str], nats: EmbeddedNats
) -> None:
    """Given a plain subscriber on jobs.new, when a job is submitted, then it gets the id."""

    async def listen_and_submit() -> tuple[subprocess.CompletedProcess[str], list[bytes]]:
        import nats as nats_py

        nc = await nats_py.connect(nats.url)
        sub = await nc.subscribe("jobs.new")
        await nc.flush()
        result = await asyncio.to_thread(
            rlfleet,
            env,
            "job",
            "submit",
            "--model",
            "tiny",
            "--dataset",
            "data.jsonl",
            "--reward-function",
            "keyword_match",
            "--gpus",
            "2",
            "--name",
            "first",
            "--",
            "--max_steps",
            "5",
            "--keywords",
            "a b",
        )
        got = [(await sub.next_msg(timeout=10)).data]
        await sub.unsubscribe()
        await nc.close()
        return result, got

    result, got = asyncio.run(listen_and_submit())
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    assert job_id.isdigit()
    assert got == [job_id.encode()]

    shown = json.loads(rlfleet(env, "job", "show", job_id, "--json").stdout)
    assert shown["status"] == "queued"
    assert shown["gpus"] == 2
    assert shown["extra_args"] == ["--max_steps", "5", "--keywords", "a b"]
    assert [e["to"] for e in shown["events"]] == ["queued"]
    assert [j["id"] for j in json.loads(rlfleet(env, "job", "list", "--json").stdout)] == [
        int(job_id)
    ]
    assert json.loads(rlfleet(env, "job", "list", "--status", "running", "--json").stdout) == []


def test_submit_with_nats_down_keeps_the_job_queued_and_says_so(
    env: dict[str, str], nats: EmbeddedNats
) -> None:
    nats.stop()
    result = rlfleet(
        env, "job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "r"
    )
    assert result.returncode == 1
    job_id = result.stdout.strip()
    assert job_id.isdigit()
    assert_one_line_error(result, 1, f"job {job_id} is queued but not announced")
    shown = json.loads(rlfleet(env, "job", "show", job_id, "--json").stdout)
    assert shown["status"] == "queued"


def test_db_current_reports_up_to_date(env: dict[str, str], tmp_path: Path) -> None:
    current = json.loads(rlfleet(env, "db", "current", "--json").stdout)
    assert current["up_to_date"] is True and current["current"] == current["head"]
