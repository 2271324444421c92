"""Exit 75 says its cause: a hub download that cannot connect is `download_failed`, not `oom`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from scheduler.states import FailureReason
from scheduler.verdicts import classify_failure
from tests.training.helpers import ARITHMETIC, train_grpo


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_a_hub_download_that_cannot_connect_exits_75_as_download_failed(tmp_path: Path) -> None:
    """The real script, its hub a loopback port nothing listens on (refused at once; the hub
    client's own retries take about a minute), a model id not in the empty cache."""
    env = {
        "HF_HUB_OFFLINE": "0",
        "HF_DATASETS_OFFLINE": "0",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
    }
    result = train_grpo(
        "--model", "nobody/not-cached", "--dataset", str(ARITHMETIC),
        "--reward_function", "xml_count", "--output_dir", str(tmp_path / "out"),
        env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 75, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    tail = result.stdout + result.stderr
    assert classify_failure(result.returncode, tail) == FailureReason.DOWNLOAD_FAILED
