"""The store's pure parts: URL checks, the status file as the poller reads it, the retry
policy of `store_error`, the wrapper's store lines."""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from scheduler.remote import store as remote_store
from scheduler.remote.launch import LaunchSpec, wrapper_script
from scheduler.remote.layout import Attempt
from scheduler.remote.probe import parse_status, parse_store_status
from scheduler.retry import GiveUp, Retry, RetryPolicy, counts_against_limit, decide
from scheduler.states import FailureReason
from scheduler.store import agent, parse_store_url
from scheduler.verdicts import classify_failure

INST = "12345678-1234-1234-1234-123456789abc"


@pytest.mark.parametrize(
    ("text", "shown", "key"),
    [
        ("s3://bucket/runs", "s3://bucket/runs", f"runs/{INST}/7"),
        ("s3://my.bucket-1/a/b/", "s3://my.bucket-1/a/b", f"a/b/{INST}/7"),
        ("s3://bucket", "s3://bucket", f"{INST}/7"),
        ("file:///shared/runs", "file:///shared/runs", f"/shared/runs/{INST}/7"),
        ("file://localhost/nfs", "file:///nfs", f"/nfs/{INST}/7"),
    ],
)
def test_store_urls_that_are_taken(text: str, shown: str, key: str):
    url = parse_store_url(text)
    assert str(url) == shown
    assert url.job_key(INST, 7) == key


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "give s3://bucket/prefix"),
        ("gs://bucket/x", "unsupported store"),
        ("https://bucket/x", "unsupported store"),
        ("/shared/runs", "unsupported store"),
        ("s3://Bucket/x", "not an S3 bucket name"),
        ("s3://b/x", "not an S3 bucket name"),
        ("s3://bucket/../x", "no '..'"),
        ("s3://bucket/a b", "without spaces"),
        ("s3://bucket/x?acl=1", "no query"),
        ("s3://bucket/%2e%2e", "no query, fragment or %-escapes"),
        ("file://host/x", "a local path"),
        ("file:///", "not the root directory"),
        ("file:///a/../b", "no '..'"),
        ("s3://bucket/$(reboot)", "letters, digits"),
        ("s3://bucket/x\n", "control characters"),
        ("s3://bucket/" + "a" * 2000, "at most 1024"),
    ],
)
def test_store_urls_that_are_refused_say_why_in_one_line(text: str, says: str):
    with pytest.raises(ValueError, match=None) as info:
        parse_store_url(text)
    message = str(info.value)
    assert says in message and "\n" not in message


def test_the_wrapper_and_the_agent_agree_on_exit_codes():
    assert remote_store.STORE_ERROR_EXIT == agent.STORE_ERROR_EXIT
    assert remote_store.FINAL_FOUND_EXIT == agent.FINAL_FOUND_EXIT


def test_a_store_status_is_read_field_by_field():
    good = {
        "store": "s3://b/x",
        "checkpoints": [
            {"step": s, "bytes": 10 * s, "at": "2026-11-25T18:00:00Z"} for s in range(9)
        ],
        "restored": 4,
        "final": True,
        "last_error": "checkpoint-8: refused\x1b[31m by the store (AccessDenied)",
        "error_at": "2026-11-25T18:00:01Z",
    }
    status = parse_store_status(json.dumps(good))
    assert status is not None
    assert [c["step"] for c in status["checkpoints"]] == [3, 4, 5, 6, 7, 8]
    assert status["restored"] == 4 and status["final"] is True
    assert "\x1b" not in status["last_error"]  # control characters never reach a terminal
    hostile = {
        "checkpoints": [{"step": -1}, {"step": True}, "x", {"step": 2, "bytes": "big"}],
        "restored": "1; rm -rf /",
        "final": "yes",
        "last_error": ["x"],
    }
    status = parse_store_status(json.dumps(hostile))
    assert status == {
        "checkpoints": [{"step": 2, "bytes": None, "at": None}],
        "restored": None,
        "final": False,
        "last_error": None,
        "error_at": None,
    }
    assert parse_store_status("[1, 2]") is None
    assert parse_store_status('{"checkpoints": [') is None


def test_the_probe_reports_a_store_error_and_status_per_attempt():
    out = "\n".join(
        [
            "rlfleet-job 3 2 exited 74",
            "rlfleet-store-error 3 2",
            "rlfleet-log 3 2 rlfleet-store: store error: Could not connect",
            'rlfleet-store 3 2 {"checkpoints": [{"step": 4, "bytes": 9, "at": "t"}]}',
            "rlfleet-job 5 1 exited 74",
            "rlfleet-log 5 1 rlfleet-store-error 5 1",  # a line of the job's own log
        ]
    )
    states = parse_status(out + "\n")
    assert states[(3, 2)].store_error and states[(3, 2)].store is not None
    assert states[(3, 2)].store["checkpoints"][0]["step"] == 4  # type: ignore[index]
    assert not states[(5, 1)].store_error


def test_exit_74_is_a_store_error_only_when_the_wrapper_says_so():
    assert classify_failure(74, store_error=True) == FailureReason.STORE_ERROR
    assert classify_failure(74) == FailureReason.EXIT_NONZERO


@dataclass
class _Job:
    retry_count: int
    max_retries: int
    attempt: int


def test_a_store_error_is_retried_with_backoff_and_not_counted():
    from scheduler.retry import Failure

    now = datetime(2026, 11, 25, tzinfo=UTC)
    policy = RetryPolicy(base_delay_s=10, factor=2, max_delay_s=600, jitter=0)
    failure = Failure(FailureReason.STORE_ERROR.value, 74)
    delays = []
    for attempt in (1, 2, 3, 4):
        decision = decide(_Job(0, 0, attempt), failure, now, random.Random(1), policy)
        assert isinstance(decision, Retry) and decision.counts is False
        delays.append((decision.at - now).total_seconds())
    assert delays == [10, 20, 40, 80]
    assert not counts_against_limit(FailureReason.STORE_ERROR.value, 74)
    limit = RetryPolicy(uncounted_limit=5)
    five = Failure(FailureReason.STORE_ERROR.value, 74, 0, {"store_error": 5})
    assert isinstance(decide(_Job(0, 0, 6), five, now, random.Random(1), limit), GiveUp)


def _spec(**fields: object) -> LaunchSpec:
    return LaunchSpec(
        run=Attempt(INST, 1, 1, "0123456789abcdef"),
        python="/opt/py env/bin/python",
        entrypoint="training.train_grpo",
        gpu_indices=[0],
        model="m",
        dataset="d",
        reward_functions=["r"],
        output_dir="~/out dir",
        **fields,  # type: ignore[arg-type]
    )


def test_the_wrapper_runs_the_agent_only_with_a_store_and_parses_as_sh():
    plain = wrapper_script(_spec())
    assert "scheduler.store.agent" not in plain and "store_error" not in plain
    with_store = wrapper_script(_spec(store="s3://bucket/runs"))
    # Isolated (`python -I`), with only the VM-level PYTHONPATH (remote/isolated.py).
    for command in ("restore", "watch", "finish"):
        assert f'"${{PYTHONPATH:-}}" {command} --store s3://bucket/runs' in with_store
    assert "exec nice -n 10 '/opt/py env/bin/python' -I -c 'import sys;" in with_store
    assert 'runpy.run_module("scheduler.store.agent", run_name="__main__"' in with_store
    assert " -m scheduler" not in with_store
    for script in (plain, with_store):
        checked = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
        assert checked.returncode == 0, checked.stderr


def test_every_rank_restores_and_rank_0_alone_uploads():
    from scheduler.remote.rendezvous import RankRendezvous

    addrs = ("10.0.0.1", "10.0.0.2")
    rank0 = wrapper_script(_spec(store="s3://bucket/runs", node=RankRendezvous(0, addrs, 29500)))
    rank1 = wrapper_script(_spec(store="s3://bucket/runs", node=RankRendezvous(1, addrs, 29500)))
    assert all(f" {c} --store" in rank0 for c in ("restore", "watch", "finish"))
    assert " restore --store" in rank1
    assert " watch --store" not in rank1 and " finish --store" not in rank1
    checked = subprocess.run(["sh", "-n"], input=rank1, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_job_pulls_progress_bar_shows_bytes_of_the_total(capsys: pytest.CaptureFixture[str]):
    from scheduler.cli.job_pull import ProgressBar, size_text
    from scheduler.pull import PullProgress

    bar = ProgressBar("job 7")
    progress = PullProgress(on_change=bar.show)
    progress.size(2_000_000)
    bar.last = 0.0
    progress.add(1_000_000)
    bar.close()
    err = capsys.readouterr().err
    assert "job 7: " + "#" * 15 + "." * 15 + " 1.0 MB / 2.0 MB" in err
    assert err.endswith("\r\x1b[K")
    assert (size_text(999), size_text(1500), size_text(3_200_000_000)) == (
        "999 B",
        "1.5 KB",
        "3.2 GB",
    )


def test_a_store_error_mark_the_job_wrote_itself_is_removed(tmp_path):
    """The end of the wrapper, run by sh: a `store_error` file the job wrote is removed;
    the wrapper's own failure writes it."""
    for failed, expected in (("", False), ("1", True)):
        d = tmp_path / f"d{failed}"
        d.mkdir()
        (d / "store_error").write_text("74\n")  # forged by the job
        script = "\n".join(
            [f"d={d}", "rc=74", f"rlfleet_store_failed={failed}", *remote_store.store_error_lines()]
        )
        subprocess.run(["sh", "-c", script], check=True)
        assert (d / "store_error").exists() is expected
