"""`rlfleet web` as a subprocess: it serves on loopback, keeps its token in a 0600 file,
and prints where the token is, never the token."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scheduler.embedded import free_port

pytestmark = pytest.mark.slow


def fetch(url: str, *, method: str = "GET", token: str | None = None) -> int:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token is not None:
        request.add_header("x-rlfleet-token", token)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_rlfleet_web_serves_and_never_prints_its_token(database_url: str, tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    env = {**os.environ, "RLFLEET_DATABASE_URL": database_url, "RLFLEET_LOG_LEVEL": "DEBUG"}
    env.pop("RLFLEET_WEB_TOKEN", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scheduler.cli",
            "web",
            "--port",
            str(port),
            "--state-dir",
            str(state),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        token_file = state / "web.token"
        assert f"http://127.0.0.1:{port}/" in first and str(token_file) in first, first
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        base = f"http://127.0.0.1:{port}"
        assert fetch(f"{base}/queue") == 200
        assert fetch(f"{base}/api/jobs") == 200
        assert fetch(f"{base}/api/jobs/1/cancel", method="POST") == 401
        assert fetch(f"{base}/api/jobs/1/cancel", method="POST", token="w" * 30) == 403
        assert fetch(f"{base}/api/jobs/1/cancel", method="POST", token=token) == 404
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert token not in first + out + err


def test_rlfleet_help_does_not_load_the_web_stack() -> None:
    code = (
        "import sys\nfrom scheduler.cli import cli\n"
        "try:\n    cli.main(['--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('starlette', 'jinja2', 'uvicorn') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip().endswith("[]"), result.stdout
