"""A job's store on the SSH test fleet, against a real S3 API (`rclone serve s3`, SigV4) on
loopback, with the real poller, dispatcher, requeue manager and train_grpo.py on the tiny
model (only the GPU is simulated; each VM has a home of its own: no shared disk).

- VM A saves checkpoints, crashes; the retry on VM B restores the newest complete one A's
  agent reported (and the poller recorded) and continues from its step (docs/invariants.md,
  invariant 10); the final model is in the store, `job pull` brings it back and it loads.
- The store down when an attempt starts: `store_error`, retried without using up a retry;
  success once it is back.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.remote.layout import default_output_dir
from scheduler.requeue import RequeueConfig
from scheduler.retry import RetryPolicy
from scheduler.transport import Transport
from tests.acceptance.test_reward_role import training_fleet
from tests.backdate import age_outages
from tests.fleet import SimFleet
from tests.s3server import S3Server, aws_env
from tests.training.helpers import ARITHMETIC
from tests.workloads.support import (
    installation,
    job_row,
    new_job,
    scheduling,
    sweep_until,
)

pytestmark = pytest.mark.slow

CONFIG = RequeueConfig(
    interval_s=0.2,
    node_lost_timeout_s=2.0,
    recheck_after_s=0.5,
    kill_grace_s=2.0,
    policy=RetryPolicy(base_delay_s=0.2, jitter=0.0),
)
MAX_STEPS = 40
TRAIN_ARGS = (
    "--keywords", "hello", "--num_generations", "4", "--per_device_train_batch_size", "4",
    "--max_completion_length", "64", "--learning_rate", "3e-3",
    "--max_steps", str(MAX_STEPS), "--save_steps", "2", "--save_total_limit", "0",
)  # fmt: skip
_MANIFEST = re.compile(r"checkpoints/checkpoint-(\d+)\.json$")


@pytest.fixture
async def s3(tmp_path: Path) -> AsyncIterator[S3Server]:
    server = S3Server(tmp_path / "s3")
    try:
        yield server
    finally:
        server.stop()


async def store_fleet(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    transport: Transport,
    s3: S3Server,
    count: int,
) -> tuple[SimFleet, GpuPoller]:
    """`count` VMs running the real training, each with the AWS configuration (in its own
    ~/.aws) that reaches `s3`."""
    fleet, poller = await training_fleet(sim_fleet, db, transport, count)
    for vm in fleet:
        s3.aws_files(vm.home)
    return fleet, poller


def stored_steps(s3: S3Server) -> list[int]:
    """The steps of the complete checkpoints in the bucket (those with a manifest)."""
    return sorted(int(m.group(1)) for k in s3.objects() if (m := _MANIFEST.search(k)))


async def store_job(db: Database, tiny: Path, s3: S3Server, **spec: object) -> int:
    return await new_job(
        db, 1, extra=TRAIN_ARGS, model=str(tiny), dataset=str(ARITHMETIC),
        reward_functions=("keyword_match",), store=f"s3://{s3.bucket}/runs", **spec,
    )  # fmt: skip


async def test_a_crashed_vm_costs_one_checkpoint_interval_and_the_model_comes_back(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    s3: S3Server,
) -> None:
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    fleet, poller = await store_fleet(sim_fleet, db, transport, s3, 2)

    async def crash(name: str) -> None:
        await fleet.by_name(name).stop(kill_processes=True)

    homes = {vm.name: vm.home for vm in fleet}
    await crash_resume_proof(db, nats, transport, poller, s3, tiny, tmp_path, homes, crash)


async def crash_resume_proof(
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    poller: GpuPoller,
    s3: S3Server,
    tiny: Path,
    tmp_path: Path,
    homes: dict[str, Path],
    crash: Callable[[str], Awaitable[None]],
) -> int:
    """Issue 22's proof on two registered VMs (`homes`: each VM's home by name, set up by
    `store_fleet` or the like): the job's VM A is crashed by `crash(name)` once a checkpoint
    of it is in the store; the retry on VM B restores it, continues from its step and
    completes; the final model is in the store and comes back with `pull` and loads.
    Returns the job's id."""
    job_id = await store_job(db, tiny, s3, max_retries=0)
    inst = await installation(db)
    deadline = time.monotonic() + 400
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        while True:  # until VM A has a complete checkpoint in the store, reported and recorded
            await poller.sweep()
            await requeue.tick()
            first = await job_row(db, job_id)
            assert first.status in ("queued", "starting", "running"), first.status_reason
            if first.status == "running" and stored_steps(s3) and await recorded_steps(db, job_id):
                break
            assert time.monotonic() < deadline, "no checkpoint reached the store"
            await asyncio.sleep(0.2)
        vm_ids = {name: vm_id for name, vm_id in (await _vm_ids(db)).items()}
        lost_name = next(n for n, i in vm_ids.items() if i == first.vm_id)
        await crash(lost_name)  # VM A crashes
        await sweep_until(poller, db, first.vm_id, "unreachable")
        # The newest checkpoint VM A's agent wrote and a poll recorded: what a retry may
        # restore (one it wrote after the last poll is not the job's until reported).
        saved = max(await recorded_steps(db, job_id))
        assert saved < MAX_STEPS, "the run ended before the crash: make it longer"
        await age_outages(db, CONFIG.node_lost_timeout_s + 1)
        while (job := await job_row(db, job_id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"job is still {job.status}"
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(0.3)
    other_home = next(home for name, home in homes.items() if name != lost_name)
    log = (Path(job.attempt_dir or "") / "train.log").read_text()
    assert job.status == "completed", (job.status_reason, log[-3000:])
    assert job.vm_id != first.vm_id and job.retry_count == 0 and job.attempt == 2
    # VM B started from a checkpoint of VM A's, at least as new as the one seen stored at
    # the crash (A may have stored one more before it died), never from step 0.
    restored = re.search(r"rlfleet-store: restored checkpoint-(\d+)", log)
    assert restored is not None, log[-3000:]
    step = int(restored.group(1))
    assert saved <= step < MAX_STEPS
    print(f"crashed with checkpoint-{saved} stored; the retry restored checkpoint-{step}")
    out = other_home / default_output_dir(inst, job_id).removeprefix("~/")
    local = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert local[0] == step and all(s > step for s in local[1:]), local
    final_state = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    assert final_state["global_step"] == MAX_STEPS
    # The final model and its marker are in the store; the status reached the job row.
    objects = s3.objects()
    prefix = f"runs/{inst}/{job_id}"
    assert f"{prefix}/final.json" in objects
    assert f"{prefix}/final/model.safetensors" in objects
    assert not any("/checkpoint-" in k and "/final/" in k for k in objects)
    assert len(stored_steps(s3)) <= 3  # the store keeps the newest three
    status = job.store_status or {}
    assert status.get("final") is True and status["checkpoints"][-1]["step"] == MAX_STEPS
    # The model comes back from the store and loads.
    from scheduler.store import parse_store_url
    from scheduler.store.backend import open_backend
    from scheduler.store.sync import pull

    dest = tmp_path / "pulled"
    with aws_env(s3):
        backend = open_backend(parse_store_url(job.store or ""), inst, job_id)
        assert pull(backend, dest) == "final"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dest)
    assert model.config.model_type == "qwen2"
    return job_id


async def recorded_steps(db: Database, job_id: int) -> list[int]:
    """The checkpoint steps the job's attempts reported writing (`job_store_records`)."""
    from scheduler.store_records import accepted

    async with db.transaction() as session:
        return sorted((await accepted(session, job_id)).checkpoints)


async def _vm_ids(db: Database) -> dict[str, int]:
    from sqlalchemy import select

    from scheduler.models import VM

    async with db.transaction() as session:
        return {n: i for n, i in (await session.execute(select(VM.name, VM.id))).all()}


async def test_the_store_down_is_a_store_error_retried_uncounted_then_success(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    s3: S3Server,
) -> None:
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    _fleet, poller = await store_fleet(sim_fleet, db, transport, s3, 1)
    s3.stop()  # the store is down for everyone
    job_id = await store_job(db, tiny, s3, max_retries=0)
    deadline = time.monotonic() + 300
    seen_store_error = False
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        while (job := await job_row(db, job_id)).status != "completed":
            assert time.monotonic() < deadline, f"job is still {job.status}"
            if job.status == "failed":
                assert job.failure_reason == "store_error", job.status_reason
                assert "store_error: " in (job.status_reason or "") or job.retry_decision
                if not seen_store_error:
                    seen_store_error = True
                    s3.start()  # back: the next attempt goes through
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(0.3)
    assert seen_store_error
    assert job.retry_count == 0 and job.attempt >= 2  # max_retries 0: none was counted
    assert any(k.endswith("/final.json") for k in s3.objects())
