"""What is in a job's store counts only once the job's own attempts reported it (issue 29,
"one job completes another"; docs/invariants.md, invariant 12), through the real launch
wrapper, store agent, poller, dispatcher and requeue manager on the SSH test fleet, with a
`file://` store every VM shares and real Postgres:

- job A's final marker, final outputs and a checkpoint, copied into job B's place, do not
  complete B (whose training always fails), are not restored by B, and `job pull B` does
  not return them; A's own pull still does.
- a job that makes its own final upload fail after exit 0 (on a store that answers) fails
  counted, and ends after its max_retries.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import text

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.errors import RlfleetError
from scheduler.gpu_poller import GpuPoller
from scheduler.models import Job
from scheduler.pull import pull_job
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import CONFIG
from tests.workloads.support import (
    installation,
    job_row,
    new_job,
    polled_fleet,
    run_to_the_end,
    scheduling,
)

pytestmark = pytest.mark.slow


async def records(db: Database, job_id: int) -> list[tuple[str, int, str]]:
    """The store records of a job: (kind, step, digest)."""
    async with db.transaction() as session:
        rows = await session.execute(
            text("SELECT kind, step, digest FROM job_store_records WHERE job_id = :j"),
            {"j": job_id},
        )
        return sorted((str(k), int(s), str(d)) for k, s, d in rows.all())


def attempt_logs(home: Path, inst: str, job_id: int) -> str:
    """Every attempt's train.log of a job on a VM whose home is `home`."""
    logs = sorted(home.glob(f".rlfleet/{inst}/jobs/{job_id}/*/train.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


async def run_until_given_up(
    db: Database, nats: EmbeddedNats, transport: Transport, poller: GpuPoller, job_id: int
) -> Job:
    """Schedule until the job is failed for good (or completed); never past attempt 2 (the
    jobs here have max_retries 1: an uncounted retry would go on)."""
    deadline = time.monotonic() + 150
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        while True:
            job = await job_row(db, job_id)
            assert job.attempt <= 2, (job.attempt, job.failure_reason, job.status_reason)
            if job.status == "completed" or (
                job.status == "failed" and job.retry_decision == "give_up"
            ):
                return job
            assert time.monotonic() < deadline, f"job {job_id} is still {job.status}"
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(0.3)


async def test_a_job_cannot_complete_restore_or_pull_from_what_another_job_left_in_its_place(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    fleet, _ids = await polled_fleet(sim_fleet, db, 1, 1)
    poller = GpuPoller(db, transport, unreachable_after=1)
    inst = await installation(db)
    store = tmp_path / "shared-store"
    url = f"file://{store}"
    out_a = tmp_path / "out-a"
    out_a.mkdir()
    (out_a / "model.safetensors").write_bytes(b"weights of job A")
    a = await new_job(db, 1, ("--fake_checkpoints",), store=url, output_dir=str(out_a))
    job = await run_to_the_end(db, nats.url, transport, poller, a, CONFIG, timeout_s=120)
    assert job.status == "completed", job.status_reason
    kinds = {(kind, step) for kind, step, _ in await records(db, a)}
    assert ("final", 0) in kinds and ("checkpoint", 5) in kinds, kinds

    # Job B, whose training always fails; job A (same store, same account) copies its own
    # marker, final outputs and newest checkpoint into B's place before B runs.
    b = await new_job(db, 1, ("--fake_exit", "1"), store=url,
                      max_retries=1)  # fmt: skip
    place_a, place_b = store / inst / str(a), store / inst / str(b)
    place_b.mkdir(parents=True)
    shutil.copy(place_a / "final.json", place_b / "final.json")
    shutil.copytree(place_a / "final", place_b / "final")
    (place_b / "checkpoints").mkdir()
    shutil.copy(place_a / "checkpoints/checkpoint-5.json", place_b / "checkpoints")
    shutil.copytree(place_a / "checkpoints/checkpoint-5", place_b / "checkpoints/checkpoint-5")
    job = await run_until_given_up(db, nats, transport, poller, b)
    log = attempt_logs(fleet[0].home, inst, b)
    assert job.status == "failed", (job.status, job.status_reason, log[-2000:])
    assert job.failure_reason == "exit_nonzero" and job.attempt == 2, job.status_reason
    assert "nothing to train" not in log and "restored checkpoint" not in log, log[-2000:]
    assert "not one this job's attempts reported" in log, log[-2000:]
    assert log.count("fake_train: args=") == 2
    assert not (fleet[0].home / f".rlfleet/{inst}/outputs/{b}/checkpoint-5").exists()
    assert await records(db, b) == []
    assert (job.store_status or {}).get("checkpoints") == [], job.store_status  # not shown

    # `job pull B` refuses A's files, naming the job and what did not match.
    dest = tmp_path / "pulled-b"
    with pytest.raises(RlfleetError) as info:
        await pull_job(db, transport, b, dest)
    said = str(info.value)
    assert f"job {b}" in said and "final.json" in said and "\n" not in said, said
    assert not dest.exists() or not any(dest.iterdir())
    with pytest.raises(RlfleetError) as info:
        await pull_job(db, transport, b, tmp_path / "pulled-b5", checkpoint=5)
    assert f"job {b}" in str(info.value) and "checkpoint-5" in str(info.value)
    assert not (tmp_path / "pulled-b5").exists() or not any((tmp_path / "pulled-b5").iterdir())

    # A's own pull still brings A's files.
    got = await pull_job(db, transport, a, tmp_path / "pulled-a")
    assert got["what"] == "final"
    assert (tmp_path / "pulled-a" / "model.safetensors").read_bytes() == b"weights of job A"


async def test_a_final_upload_the_job_makes_fail_after_exit_0_is_counted_to_its_end(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    await polled_fleet(sim_fleet, db, 1, 1)
    poller = GpuPoller(db, transport, unreachable_after=1)
    inst = await installation(db)
    store = tmp_path / "store"
    extra = ("--fake_block_final", str(store / inst))
    job_id = await new_job(db, 1, extra, store=f"file://{store}", max_retries=1)
    job = await run_until_given_up(db, nats, transport, poller, job_id)
    assert job.attempt == 2 and job.retry_count == 1, (job.attempt, job.retry_count)
    assert job.failure_reason == "exit_nonzero", job.status_reason
    # Each attempt's failure says why (the give-up reason then names the class).
    async with db.transaction() as session:
        found = await session.execute(
            text("SELECT reason FROM job_events WHERE job_id = :j AND to_status = 'failed'"
                 " AND actor = 'poller' ORDER BY id"), {"j": job_id})  # fmt: skip
        reasons = [str(r) for (r,) in found.all()]
    assert len(reasons) == 2, reasons
    for reason in reasons:
        assert reason.startswith("exited 0, but the final outputs could not be uploaded"), reason
        assert "store answered" in reason and "writing final/" in reason, reason
