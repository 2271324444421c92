"""What binds store content to the attempts that made it (`scheduler.store.binding`), the
pure parts: what a status file may report (checked like everything from a VM), the
agent's `--accept` words there and back, the wrapper's quoting of them, and the verdict
of a final upload refused by a store that answered."""

from __future__ import annotations

import json
import subprocess

import pytest

from scheduler.remote.launch import wrapper_script
from scheduler.remote.probe import RemoteJobState, parse_status
from scheduler.remote.store import FINAL_REFUSED_EXIT
from scheduler.states import FailureReason, JobStatus
from scheduler.store import agent
from scheduler.store.binding import Accepted, reported
from scheduler.verdicts import LiveJob, job_verdict
from tests.unit.test_store import _spec

D1, D2, D3 = "a" * 64, "0123456789abcdef" * 4, "f" * 64


def test_a_status_file_reports_only_checked_digests():
    good = {
        "checkpoints": [{"step": 2, "digest": D1}, {"step": 4, "digest": D2}],
        "final_digest": D3,
    }
    assert reported(good) == [("checkpoint", 2, D1), ("checkpoint", 4, D2), ("final", 0, D3)]
    hostile = {
        "checkpoints": [
            {"step": 1, "digest": D1.upper()},  # not as rlfleet writes one
            {"step": 1, "digest": D1[:63]},
            {"step": 1, "digest": D1 + "0"},
            {"step": 1, "digest": " " + D1},
            {"step": -1, "digest": D1},
            {"step": 10**9, "digest": D1},  # past the steps a store holds
            {"step": True, "digest": D1},
            {"step": 3.0, "digest": D1},
            {"step": 5, "digest": ["x"]},
            "checkpoint-6",
        ],
        "final_digest": {"x": D1},
    }
    assert reported(hostile) == []
    assert reported([D1]) == [] and reported(None) == []
    many = {"checkpoints": [{"step": s, "digest": D1} for s in range(50)], "final_digest": D2}
    assert len(reported(many)) == 7  # the newest six and the final


def test_the_probe_carries_the_digests_of_an_attempts_status():
    status = {"checkpoints": [{"step": 4, "bytes": 9, "at": "t", "digest": D1}],
              "final": True, "final_digest": D2}  # fmt: skip
    out = f"rlfleet-job 3 2 exited 0\nrlfleet-store 3 2 {json.dumps(status)}\n"
    state = parse_status(out)[(3, 2)]
    assert state.store_digests == (("checkpoint", 4, D1), ("final", 0, D2))
    assert "digest" not in json.dumps(state.store)  # job show's status stays as it was
    garbage = "rlfleet-job 3 2 exited 0\nrlfleet-store 3 2 " + "[" * 3000 + "\n"
    assert parse_status(garbage)[(3, 2)].store_digests == ()


def test_accept_words_go_there_and_back_and_anything_else_is_refused():
    accepted = Accepted.of([("final", 0, D1), ("checkpoint", 4, D2), ("checkpoint", 4, D3),
                            ("checkpoint", 7, "nothex"), ("other", 1, D1)])  # fmt: skip
    assert accepted.words() == (f"final={D1}", f"4={D2}", f"4={D3}")
    assert Accepted.parse(accepted.words()) == accepted
    for word in (f"final={D1[:10]}", f"-1={D1}", f"1e3={D1}", f"1234567890={D1}", "final",
                 f"final={D1};rm -rf ~", f"4 ={D1}"):  # fmt: skip
        with pytest.raises(ValueError, match="--accept"):
            Accepted.parse([word])


def test_the_wrapper_hands_every_agent_the_accepted_digests_quoted():
    words = Accepted.of([("final", 0, D1), ("checkpoint", 4, D2)]).words()
    script = wrapper_script(_spec(store="s3://bucket/runs", store_accept=words))
    for command in ("restore", "watch", "finish"):
        line = next(
            ln
            for ln in script.splitlines()
            if "scheduler.store.agent" in ln and f' "${{PYTHONPATH:-}}" {command} ' in ln
        )
        assert f"--accept final={D1} --accept 4={D2}" in line, line
    checked = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_a_final_upload_refused_by_a_store_that_answered_is_the_jobs_failure_counted():
    assert agent.FINAL_REFUSED_EXIT == FINAL_REFUSED_EXIT
    job = LiveJob(id=7, vm_id=1, status="running", attempt_number=2, remote_pid=42)
    said = ("rlfleet-store: uploading the final outputs failed: writing final/m: Not a directory\n"
            "rlfleet-store: the final outputs could not be uploaded and the store answered:"
            " writing final/m: Not a directory")  # fmt: skip
    verdict = job_verdict(job, RemoteJobState("exited", FINAL_REFUSED_EXIT, said))
    assert verdict is not None and verdict.to == JobStatus.FAILED
    assert verdict.failure_reason == FailureReason.EXIT_NONZERO  # counted
    assert verdict.reason.startswith("exited 0, but the final outputs could not be uploaded")
    # The same exit without the agent's line is the job's own exit 73.
    plain = job_verdict(job, RemoteJobState("exited", FINAL_REFUSED_EXIT, "boom"))
    assert plain is not None and plain.reason == "exited 73"


def test_a_full_status_file_stays_within_what_a_poll_reads(tmp_path):
    from scheduler.remote.store import STORE_STATUS_BYTES

    url = "s3://bucket/" + "p" * 1000  # the longest URL a store may have
    status = agent.Status(tmp_path / "store.json", url)
    for step in range(999_999_990, 999_999_996):
        status.add_checkpoint(step, 10**15, D1)
    status.update(final=True, final_digest=D2, restored=999_999_990)
    status.error("\x01" * 400)  # each one 6 bytes as JSON writes it
    raw = (tmp_path / "store.json").read_bytes()
    assert len(raw) <= STORE_STATUS_BYTES, len(raw)
    state = parse_status(f"rlfleet-job 3 2 running\nrlfleet-store 3 2 {raw.decode()}\n")[(3, 2)]
    assert len(state.store_digests) == 7 and ("final", 0, D2) in state.store_digests
