"""A job with a `file://` store through the real launch wrapper, poller, dispatcher and
requeue manager on the SSH test fleet (fake_train: no torch): the final outputs and marker
reach the store after exit 0, and an attempt that finds the marker already there exits 0
without training."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest

from scheduler.control import cancel_job
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.store_records import accepted, record
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import CONFIG
from tests.workloads.support import (
    installation,
    new_job,
    polled_fleet,
    publish,
    run_to_the_end,
    running_dispatcher,
    wait_status,
)

pytestmark = pytest.mark.slow


async def test_the_final_outputs_reach_a_directory_store_and_a_marker_skips_training(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    await polled_fleet(sim_fleet, db, 1, 1)
    poller = GpuPoller(db, transport, unreachable_after=1)
    inst = await installation(db)
    store = tmp_path / "shared-store"
    url = f"file://{store}"
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    first = await new_job(db, 1, store=url, output_dir=str(out))
    job = await run_to_the_end(db, nats.url, transport, poller, first, CONFIG, timeout_s=120)
    log = (Path(job.attempt_dir or "") / "train.log").read_text()
    assert job.status == "completed", (job.status_reason, log[-2000:])
    assert "fake_train: args=" in log and "training starts fresh" in log
    base = store / inst / str(first)
    marker = json.loads((base / "final.json").read_text())
    assert marker["files"] == {"model.safetensors": 7}
    assert (base / "final" / "model.safetensors").read_bytes() == b"weights"
    assert (job.store_status or {}).get("final") is True
    # The poller recorded the digest of the marker the attempt wrote (nothing else).
    async with db.transaction() as session:
        bound = await accepted(session, first)
    assert bound.final == {hashlib.sha256((base / "final.json").read_bytes()).hexdigest()}

    # A job whose final marker is already in the store (its last attempt finished
    # during a partition that hid it, after the poll that recorded its marker): the
    # attempt exits 0 without training.
    second = await new_job(db, 1, store=url)
    done = store / inst / str(second)
    done.mkdir(parents=True)
    marker = json.dumps({"files": {}, "sha256": {}, "at": "2026-11-25T18:00:00Z"}).encode()
    (done / "final.json").write_bytes(marker)
    async with db.transaction() as session:
        await record(session, [(second, 0, "final", 0, hashlib.sha256(marker).hexdigest())])
    job = await run_to_the_end(db, nats.url, transport, poller, second, CONFIG, timeout_s=120)
    log = (Path(job.attempt_dir or "") / "train.log").read_text()
    assert job.status == "completed", (job.status_reason, log[-2000:])
    assert "already in the store: nothing to train" in log
    assert "fake_train: args=" not in log


def _agents(fleet: SimFleet) -> list[str]:
    """The command lines of the store agents running on the fleet's VMs."""
    found = []
    for vm in fleet:
        for pid in vm.processes():
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "scheduler.store.agent" in line:
                found.append(line)
    return found


async def test_a_cancelled_store_job_leaves_no_uploader_behind(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    fleet, _ids = await polled_fleet(sim_fleet, db, 1, 1)
    job_id = await new_job(db, 1, ("--fake_seconds", "120"), store=f"file://{tmp_path}/store")
    nc = await nats_client.connect(nats.url)
    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            await publish(nc, job_id)
            await wait_status(db, job_id, "running")
            deadline = time.monotonic() + 30
            while not any(" watch " in line for line in _agents(fleet)):
                assert time.monotonic() < deadline, "the uploader never started"
                await asyncio.sleep(0.1)
            await cancel_job(db, transport, job_id, grace_s=2.0)
    finally:
        await nc.close()
    deadline = time.monotonic() + 30
    while left := _agents(fleet):
        assert time.monotonic() < deadline, f"left running: {left}"
        await asyncio.sleep(0.1)
