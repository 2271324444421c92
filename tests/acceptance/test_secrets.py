"""Secrets are never printed: the real CLI and a real daemon, pointed at unreachable
services with credentials in their URLs, say what failed in one line and never show a
password or a token (docs/invariants.md, invariant 7)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from scheduler.embedded import free_port
from tests.workloads.support import RLFLEET

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

SECRET = "Hunter2-xyz"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`rlfleet ARGS` with no service variables of the caller's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    return subprocess.run(
        [str(RLFLEET), *args], env={**clean, **(env or {})}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://bob:{s}@127.0.0.1:{p}/rl", "postgresql+psycopg://bob:***@127.0.0.1:{p}/rl"),
        (
            "postgresql://bob@127.0.0.1:{p}/rl?password={s}",
            "postgresql+psycopg://bob@127.0.0.1:{p}/rl?password=***",
        ),
        (
            "postgresql://bob:a@b:{s}@127.0.0.1:{p}/rl",
            "postgresql+psycopg://bob:***@127.0.0.1:{p}/rl",
        ),
        ("postgresql://bob:{s}@[::1]:{p}/rl", "postgresql+psycopg://bob:***@[::1]:{p}/rl"),
    ],
)
def test_unreachable_database_is_one_line_without_the_password(url: str, shown: str) -> None:
    port = free_port()
    result = run_cli("--database-url", url.format(s=SECRET, p=port), "job", "list")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert SECRET not in result.stderr and "a@b" not in result.stderr
    assert shown.format(p=port) in lines[0]


@pytest.mark.parametrize(
    "url", ["postgresql://bob:{s}@[::1:5432/rl", "postgresql://bob:{s}@h:port/rl", "{s}"]
)
def test_malformed_database_url_is_exit_2_and_one_line(url: str) -> None:
    result = run_cli("job", "list", env={"RLFLEET_DATABASE_URL": url.format(s=SECRET)})
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert SECRET not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("creds", [f"{SECRET}@", f"alice:{SECRET}@"])
def test_daemon_reconnect_logs_never_show_nats_credentials(creds: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [str(RLFLEET), "--log-level", "DEBUG", "dispatcher"],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")},
            "RLFLEET_DATABASE_URL": f"postgresql://bob:{SECRET}@127.0.0.1:{free_port()}/rl",
            "RLFLEET_NATS_URL": f"nats://{creds}127.0.0.1:{port}",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        # Until several connect attempts were logged, however long the machine takes.
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while sum("nats_connect_failed" in line for line in lines) < 3:
            assert time.monotonic() < deadline, "".join(lines)
            line = proc.stdout.readline()
            assert line, "the dispatcher exited:\n" + "".join(lines)
            lines.append(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert f"127.0.0.1:{port}" in out
    assert SECRET not in out
