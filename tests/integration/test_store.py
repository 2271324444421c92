"""The store's copying and its VM-side agent against a real S3 API on loopback
(`rclone serve s3`, SigV4 keys) and a directory store: a checkpoint counts once complete
and settled, a half-written one is never restored, an upload failing mid-run is retried
and shown, the agent's exit codes say what the wrapper must do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.store import parse_store_url
from scheduler.store.agent import FINAL_FOUND_EXIT, STORE_ERROR_EXIT, Status, Watcher
from scheduler.store.backend import Backend, StoreError, open_backend
from scheduler.store.sync import (
    pull,
    restore_newest,
    stored_checkpoints,
    upload_checkpoint,
    upload_final,
)
from tests.s3server import S3Server, aws_env

INST = "12345678-1234-1234-1234-123456789abc"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        with aws_env(server):
            yield server
    finally:
        server.stop()


_JOB = iter(range(1, 10_000))


@pytest.fixture(params=["s3", "file"])
def backend(request: pytest.FixtureRequest, s3: S3Server, tmp_path: Path) -> Backend:
    job = next(_JOB)
    if request.param == "s3":
        return open_backend(parse_store_url(f"s3://{s3.bucket}/t"), INST, job)
    return open_backend(parse_store_url(f"file://{tmp_path}/store"), INST, job)


def checkpoint(out: Path, step: int, *, complete: bool = True, size: int = 1000) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(os.urandom(size))
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "optimizer.pt").write_bytes(b"o" * 10)
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_the_newest_complete_checkpoint_is_restored_never_a_half_written_one(
    backend: Backend, tmp_path: Path
):
    out = tmp_path / "a"
    checkpoint(out, 2)
    assert upload_checkpoint(backend, out, 2) == 1000 + 10 + len('{"global_step": 2}')
    # Checkpoint 4 was being uploaded when its VM died: its files, no manifest.
    four = checkpoint(out, 4)
    for rel in ("model.safetensors", "sub/optimizer.pt"):
        backend.put_file(four / rel, f"checkpoints/checkpoint-4/{rel}")
    assert sorted(stored_checkpoints(backend)) == [2]
    b = tmp_path / "b"
    assert restore_newest(backend, b) == 2
    restored = b / "checkpoint-2"
    assert (restored / "model.safetensors").read_bytes() == (
        out / "checkpoint-2" / "model.safetensors"
    ).read_bytes()
    assert (restored / "sub" / "optimizer.pt").is_file()
    assert sorted(p.name for p in b.iterdir()) == ["checkpoint-2"]


def test_a_checkpoint_whose_files_differ_from_its_manifest_is_not_put_in_place(
    backend: Backend, tmp_path: Path
):
    out = tmp_path / "a"
    checkpoint(out, 6)
    upload_checkpoint(backend, out, 6)
    backend.put_bytes(b"short", "checkpoints/checkpoint-6/model.safetensors")
    b = tmp_path / "b"
    with pytest.raises(StoreError, match="manifest says 1000"):
        restore_newest(backend, b)
    assert not (b / "checkpoint-6").exists()  # --resume auto never sees it


def test_a_manifest_naming_a_path_outside_is_not_one_rlfleet_wrote(
    backend: Backend, tmp_path: Path
):
    backend.put_bytes(
        json.dumps({"files": {"../../.bashrc": 3}, "at": "x"}).encode(),
        "checkpoints/checkpoint-9.json",
    )
    assert stored_checkpoints(backend) == {}
    assert restore_newest(backend, tmp_path / "b") is None
    assert not (tmp_path / ".bashrc").exists()


def test_the_watcher_uploads_a_checkpoint_once_complete_and_settled_and_keeps_three(
    backend: Backend, tmp_path: Path
):
    out = tmp_path / "out"
    status = Status(tmp_path / "store.json", "s3://x")
    watcher = Watcher(backend, out, status, settle_s=0.0)
    watcher.start()
    checkpoint(out, 2, complete=False)
    watcher.scan()
    watcher.scan()
    assert stored_checkpoints(backend) == {}  # no trainer_state.json: still being written
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    watcher.scan()  # seen once: it may still change
    assert stored_checkpoints(backend) == {}
    watcher.scan()
    assert sorted(stored_checkpoints(backend)) == [2]
    for step in (4, 6, 8):
        checkpoint(out, step)
        watcher.scan()
        watcher.scan()
    assert sorted(stored_checkpoints(backend)) == [4, 6, 8]
    assert not any(k.startswith("checkpoints/checkpoint-2/") for k in backend.list())
    shown = json.loads((tmp_path / "store.json").read_text())
    assert [c["step"] for c in shown["checkpoints"]] == [2, 4, 6, 8]
    assert shown["last_error"] is None


def test_an_upload_failing_mid_run_is_retried_and_shown(s3: S3Server, tmp_path: Path):
    backend = open_backend(parse_store_url(f"s3://{s3.bucket}/t"), INST, next(_JOB))
    out = tmp_path / "out"
    status = Status(tmp_path / "store.json", "s3://x")
    watcher = Watcher(backend, out, status, settle_s=0.0)
    watcher.start()
    checkpoint(out, 2)
    watcher.scan()
    s3.stop()
    try:
        watcher.scan()  # raises nothing: training goes on
        shown = json.loads((tmp_path / "store.json").read_text())
        assert "checkpoint-2" in shown["last_error"] and shown["error_at"]
    finally:
        s3.start()
    watcher.retry_at = 0.0  # the backoff has passed
    watcher.scan()
    assert sorted(stored_checkpoints(backend)) == [2]
    assert json.loads((tmp_path / "store.json").read_text())["last_error"] is None


def _agent(
    command: str, store: str, job: int, out: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler.store.agent",
            command,
            "--store",
            store,
            "--installation",
            INST,
            "--job-id",
            str(job),
            "--output-dir",
            str(out),
            "--status",
            str(out.parent / "store.json"),
            *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_the_agent_says_by_its_exit_code_what_the_wrapper_must_do(s3: S3Server, tmp_path: Path):
    store = f"s3://{s3.bucket}/agent"
    job = next(_JOB)
    out = tmp_path / "out"
    fresh = _agent("restore", store, job, out)
    assert fresh.returncode == 0 and "training starts fresh" in fresh.stderr
    checkpoint(out, 3)
    (out / "model.safetensors").write_bytes(b"final weights")
    (out / "tokenizer.json").write_text("{}")
    done = _agent("finish", store, job, out, "--final")
    assert done.returncode == 0, done.stderr
    # What the poller reads of the attempt and records: the digests of what it wrote.
    reported = json.loads((out.parent / "store.json").read_text())
    final = reported["final_digest"]
    assert re.fullmatch(r"[0-9a-f]{64}", final), reported
    other = tmp_path / "b" / "out"
    other.parent.mkdir()  # the attempt directory, where the status file goes
    unbound = _agent("restore", store, job, other)
    assert unbound.returncode == 0, unbound.stderr  # not reported: it trains
    assert "final marker in the store is not one this job's attempts reported" in unbound.stderr
    found = _agent("restore", store, job, other, "--accept", f"final={final}")
    assert found.returncode == FINAL_FOUND_EXIT, found.stderr
    assert "already in the store" in found.stderr
    s3.stop()
    try:
        down = _agent("restore", store, job, other)
    finally:
        s3.start()
    assert down.returncode == STORE_ERROR_EXIT
    assert down.stderr.count("\n") == 1 and "store error" in down.stderr
    assert s3.secret not in down.stderr and s3.key not in down.stderr
    status = json.loads((other.parent / "store.json").read_text())
    assert status["last_error"] and s3.secret not in json.dumps(status)


def test_pull_brings_back_the_final_outputs_or_a_checkpoint(backend: Backend, tmp_path: Path):
    out = tmp_path / "out"
    checkpoint(out, 5)
    upload_checkpoint(backend, out, 5)
    with pytest.raises(StoreError, match="not in the store"):
        pull(backend, tmp_path / "none")
    (out / "model.safetensors").write_bytes(b"w" * 50)
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    upload_final(backend, out)
    dest = tmp_path / "dest"
    assert pull(backend, dest) == "final"
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "adapter/adapter_config.json",
        "model.safetensors",
    ]
    assert pull(backend, tmp_path / "c5", checkpoint=5) == "checkpoint-5"
    assert (tmp_path / "c5" / "trainer_state.json").is_file()
    with pytest.raises(StoreError, match=r"no complete checkpoint 7 in the store \(steps: 5\)"):
        pull(backend, tmp_path / "c7", checkpoint=7)


def test_only_a_checkpoint_the_job_reported_is_restored_and_each_file_is_checked(
    backend: Backend, tmp_path: Path
):
    out = tmp_path / "a"
    checkpoint(out, 2)
    digests: list[str] = []
    upload_checkpoint(backend, out, 2, digests.append)
    own = digests[-1]
    # Another job's checkpoint-4 put into this job's place: a manifest rlfleet could have
    # written, with files that match it, but no attempt of this job reported it.
    checkpoint(out, 4)
    upload_checkpoint(backend, out, 4)
    said: list[str] = []
    b = tmp_path / "b"
    assert restore_newest(backend, b, accepted_digests={2: {own}}, on_refused=said.append) == 2
    assert sorted(p.name for p in b.iterdir()) == ["checkpoint-2"]
    assert restore_newest(backend, tmp_path / "c", accepted_digests={}) is None
    # A file swapped under the reported manifest (same size): passed over, never in place.
    backend.put_bytes(b"x" * 1000, "checkpoints/checkpoint-2/model.safetensors")
    d = tmp_path / "d"
    assert restore_newest(backend, d, accepted_digests={2: {own}}, on_refused=said.append) is None
    assert not (d / "checkpoint-2").exists()
    assert said and "model.safetensors: its sha256 is not the one its manifest lists" in said[-1]


def test_pull_takes_only_what_the_job_reported(backend: Backend, tmp_path: Path):
    from scheduler.store.binding import NotReported

    out = tmp_path / "out"
    (out / "model.safetensors").parent.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"w" * 50)
    digests: list[str] = []
    upload_final(backend, out, on_digest=digests.append)
    with pytest.raises(NotReported, match="final.json in the store is not one this job's"):
        pull(backend, tmp_path / "none", accepted_digests=frozenset())
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())
    assert pull(backend, tmp_path / "ok", accepted_digests=frozenset(digests)) == "final"
    backend.put_bytes(b"v" * 50, "final/model.safetensors")
    dest = tmp_path / "swapped"
    with pytest.raises(NotReported, match="model.safetensors: its sha256"):
        pull(backend, dest, accepted_digests=frozenset(digests))
    assert not dest.exists() or not any(dest.iterdir())


def test_checkpoints_another_job_put_in_the_place_never_push_out_the_jobs_own(
    backend: Backend, tmp_path: Path
):
    # Three checkpoints of higher steps than the job will reach, put in its place by
    # another job (their manifests and files as rlfleet writes them).
    forged = tmp_path / "forged"
    for step in (900, 901, 902):
        checkpoint(forged, step)
        upload_checkpoint(backend, forged, step)
    out = tmp_path / "out"
    watcher = Watcher(backend, out, Status(tmp_path / "store.json", "s3://x"), settle_s=0.0)
    watcher.start()
    for step in (2, 4):
        checkpoint(out, step)
        watcher.scan()
        watcher.scan()
    assert sorted(stored_checkpoints(backend)) == [2, 4]  # the others' are gone, not its own
    shown = json.loads((tmp_path / "store.json").read_text())
    assert [c["step"] for c in shown["checkpoints"] if c.get("digest")] == [2, 4]
