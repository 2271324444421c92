"""The exit code that counts when a process of a multi-process launch fails: torch's
launcher (under `accelerate launch`) exits 1 and names the failed process's own code in its
report; the poller's verdict reads it from the end of the log, as the status probe returns
it, so a bad argument under several processes is still a config error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.remote.probe import LOG_TAIL_BYTES, LOG_TAIL_LINES, RemoteJobState
from scheduler.states import FailureReason
from scheduler.verdicts import LiveJob, job_verdict
from tests.training.test_multinode import free_port

pytestmark = pytest.mark.slow

FAILING = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("train-grpo: error: --reward_function nope: no such reward", file=sys.stderr)
    sys.exit(64)
time.sleep(60)
"""


def test_a_process_exiting_64_under_the_launcher_is_a_config_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(FAILING)
    argv = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_machines", "1", "--machine_rank", "0",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
        "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(script),
    ]  # fmt: skip
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 1, ran.stderr[-2000:]
    # The probe's tail: the last lines of train.log, at most so many bytes.
    lines = (ran.stdout + ran.stderr).splitlines(keepends=True)[-LOG_TAIL_LINES:]
    tail = "".join(lines).encode()[-LOG_TAIL_BYTES:].decode(errors="replace")
    verdict = job_verdict(LiveJob(7, 1, "running", 1, 4242), RemoteJobState("exited", 1, tail))
    assert verdict is not None
    assert (verdict.exit_code, verdict.failure_reason) == (64, FailureReason.CONFIG_ERROR)
    assert verdict.reason == "exited 1: its first failed process exited 64"
