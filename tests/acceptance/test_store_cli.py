"""`job submit --store`, `job show` and `job pull` through the real CLI (real Postgres and
NATS; a real S3 API on loopback, `rclone serve s3`; for a job without a store, a VM of the
SSH test fleet)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from scheduler.db import Database
from scheduler.store_records import record
from tests.acceptance.test_cli_input import (
    SUBMIT,
    add_polled_vm,
    assert_one_line,
    env,
    rlfleet,
    sql,
)
from tests.fleet import SimFleet
from tests.s3server import S3Server, aws_env
from tests.workloads.support import installation

__all__ = ["env"]

pytestmark = pytest.mark.slow


def test_a_store_is_checked_recorded_and_shown(env: dict[str, str], tmp_path: Path):
    add_polled_vm(env, "gpu-1", 1)
    submitted = rlfleet(env, *SUBMIT, "--store", "s3://bucket/runs/", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    shown = rlfleet(env, "job", "show", job_id, "--no-progress")
    assert "s3://bucket/runs\n" in shown.stdout and "stored steps:     none yet" in shown.stdout
    status = {
        "checkpoints": [{"step": s, "bytes": 1500, "at": f"T{s}"} for s in (2, 4)],
        "restored": 2, "final": True, "last_error": "checkpoint-6: refused", "error_at": "T6",
    }  # fmt: skip
    sql(env["RLFLEET_DATABASE_URL"],
        f"UPDATE jobs SET store_status = '{json.dumps(status)}' WHERE id = {job_id}")  # fmt: skip
    shown = rlfleet(env, "job", "show", job_id, "--no-progress").stdout
    assert f"outputs:          in the store (rlfleet job pull {job_id})" in shown
    assert "stored steps:     4 (1.5 KB, T4), 2 (1.5 KB, T2)" in shown
    assert "restored from:    checkpoint-2" in shown
    assert "upload error:     checkpoint-6: refused (at T6)" in shown
    # RLFLEET_STORE is the default; a job file's store: key wins.
    defaulted = rlfleet({**env, "RLFLEET_STORE": "file:///shared/runs"}, *SUBMIT, "--json")
    job2 = str(json.loads(defaulted.stdout)["id"])
    listed = json.loads(rlfleet(env, "job", "show", job2, "--json", "--no-progress").stdout)
    assert listed["store"] == "file:///shared/runs" and listed["store_status"] is None
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "store: s3://other/x\nroles:\n  train:\n    gpus: 1\n    train:\n"
        "      model: m\n      dataset: d\n      reward_functions: [format]\n"
    )
    from_file = rlfleet({**env, "RLFLEET_STORE": "file:///shared/runs"}, "job", "submit",
                        "-f", str(spec), "--json")  # fmt: skip
    assert from_file.returncode == 0, from_file.stderr
    job3 = str(json.loads(from_file.stdout)["id"])
    shown3 = json.loads(rlfleet(env, "job", "show", job3, "--json", "--no-progress").stdout)
    assert shown3["store"] == "s3://other/x"
    # Refused, one line, nothing inserted.
    assert_one_line(rlfleet(env, *SUBMIT, "--store", "gs://b/x"), 2, "unsupported store")
    assert_one_line(
        rlfleet({**env, "RLFLEET_STORE": "s3://b/../x"}, *SUBMIT), 2, "(from $RLFLEET_STORE)"
    )
    spec.write_text(spec.read_text().replace("s3://other/x", "s3://other/a b"))
    assert_one_line(rlfleet(env, "job", "submit", "-f", str(spec)), 2, "store: ")
    assert len(json.loads(rlfleet(env, "job", "list", "--json").stdout)) == 3


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path / "s3")
    try:
        yield server
    finally:
        server.stop()


async def test_job_pull_brings_the_final_model_back_from_the_store(
    env: dict[str, str], db: Database, s3: S3Server, tmp_path: Path
):
    from scheduler.store import parse_store_url
    from scheduler.store.backend import open_backend
    from scheduler.store.sync import upload_checkpoint, upload_final

    add_polled_vm(env, "gpu-1", 1)
    submitted = rlfleet(env, *SUBMIT, "--store", f"s3://{s3.bucket}/runs", "--json")
    job_id = int(json.loads(submitted.stdout)["id"])
    user = {**env, **s3.env()}
    dest = tmp_path / "model"
    assert_one_line(rlfleet(user, "job", "pull", str(job_id), str(dest)), 1, "not in the store")
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    (out / "model.safetensors").write_bytes(os.urandom(3000))
    (out / "tokenizer.json").write_text("{}")
    four: list[str] = []
    final: list[str] = []
    with aws_env(s3):
        backend = open_backend(parse_store_url(f"s3://{s3.bucket}/runs"), await installation(db),
                               job_id)  # fmt: skip
        upload_checkpoint(backend, out, 4, four.append)
        upload_final(backend, out, on_digest=final.append)
    # In the store, but no attempt of the job reported writing it: not the job's.
    said = f"job {job_id}: final.json in the store is not one this job's attempts reported"
    assert_one_line(rlfleet(user, "job", "pull", str(job_id), str(dest)), 1, said)
    assert not dest.exists() or not any(dest.iterdir())
    async with db.transaction() as session:  # what the poller records of its attempt
        await record(session, [(job_id, 0, "final", 0, final[-1]),
                               (job_id, 0, "checkpoint", 4, four[-1])])  # fmt: skip
    pulled = rlfleet(user, "job", "pull", str(job_id), str(dest), "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["what"] == "final"
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert (dest / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert s3.secret not in pulled.stdout + pulled.stderr
    # A destination with files in it is refused; --checkpoint N takes that checkpoint.
    assert_one_line(rlfleet(user, "job", "pull", str(job_id), str(dest)), 2, "not an empty")
    ck = rlfleet(user, "job", "pull", str(job_id), str(tmp_path / "c4"), "--checkpoint", "4")
    assert ck.returncode == 0 and (tmp_path / "c4" / "trainer_state.json").is_file(), ck.stderr
    assert_one_line(
        rlfleet(user, "job", "pull", str(job_id), str(tmp_path / "c9"), "--checkpoint", "9"),
        1,
        "no complete checkpoint 9 in the store (steps: 4)",
    )


async def test_job_pull_without_a_store_copies_from_the_vm_over_ssh(
    env: dict[str, str],
    db: Database,
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    tmp_path: Path,
):
    fleet = await sim_fleet(1)
    ids = await fleet.register(db)
    vm = fleet[0]
    out = vm.home / "run out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights" * 100)
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text("{}")
    (out / "escape").symlink_to("/etc/passwd")  # a link out of DEST is left out
    submitted = rlfleet(env, *SUBMIT, "--output-dir", "run out", "--json")
    job_id = int(json.loads(submitted.stdout)["id"])
    early = rlfleet(env, "job", "pull", str(job_id), str(tmp_path / "x"))
    assert_one_line(early, 1, "it has no final model yet")
    sql(
        env["RLFLEET_DATABASE_URL"],
        f"UPDATE jobs SET status = 'completed', vm_id = {ids[vm.name]} WHERE id = {job_id}",
    )
    dest = tmp_path / "pulled"
    # The VM answers from this test's event loop: the CLI runs beside it, in a thread.
    pulled = await asyncio.to_thread(rlfleet, env, "job", "pull", str(job_id), str(dest), "--json")
    assert pulled.returncode == 0, pulled.stderr
    result = json.loads(pulled.stdout)
    assert result["from"] == f"{vm.name}:run out" and result["skipped"] == 1
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*"))
    assert files == ["adapter", "adapter/adapter_config.json", "model.safetensors"]
    ck = await asyncio.to_thread(
        rlfleet, env, "job", "pull", str(job_id), str(tmp_path / "c2"), "--checkpoint", "2"
    )
    assert ck.returncode == 0 and (tmp_path / "c2" / "trainer_state.json").is_file(), ck.stderr
    missing = await asyncio.to_thread(
        rlfleet, env, "job", "pull", str(job_id), str(tmp_path / "c3"), "--checkpoint", "3"
    )
    assert_one_line(missing, 1, "no such directory on this VM")
