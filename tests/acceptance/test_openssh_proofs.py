"""The third wave's key proofs on VMs behind OpenSSH's real sshd (tests/sshd.py), the server
users run, rather than the test fleet's in-process SSH servers: real Postgres, NATS,
poller, dispatcher, requeue manager, S3 API (`rclone serve s3`) and train_grpo.py on the
tiny model; only the GPU is simulated. Each VM has a home of its own (no shared disk) and
gets nothing of the test's environment but what its `~/.rlfleet/env` and `~/.aws` say.

- Issue 22: VM A crashes (its sshd and every process of its sessions SIGKILLed) after it
  stored checkpoint N; the retry on VM B restores it and continues from step N; the final
  model is in the store, comes back and loads.
- Issue 23: a trainer that stops advancing is stopped within hang_timeout + one poll, its
  diagnostics kept (py-spy's stacks among them), and resumes elsewhere from its checkpoint
  (in an output directory both VMs mount); a slow trainer is never stopped;
  a reward-server role killed mid-run is restarted in place and the trainer completes with
  every reward scored.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.models import Leftover
from scheduler.transport import Transport
from tests.acceptance.test_reward_role import reward_restart_proof
from tests.acceptance.test_store_fleet import crash_resume_proof, s3  # noqa: F401 (fixture)
from tests.integration.test_hang import CONFIG as HANG_CONFIG
from tests.integration.test_hang import (
    failed_events,
    hung_trainer_proof,
    rlfleet,
)
from tests.s3server import S3Server
from tests.sshd import SshdFleet, sshd_fleet  # noqa: F401 (the fixture)
from tests.workloads.support import (
    FAKE_TRAIN,
    RLFLEET,
    attempt_dirs,
    daemons,
    installation,
    new_job,
    read_records,
    wait_status,
)

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


async def training_fleet(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    transport: Transport,
    count: int,
) -> tuple[SshdFleet, GpuPoller]:
    """`count` one-GPU sshd VMs that run the real training entrypoint offline (no hub
    downloads, one CPU thread), registered, and a poller that has swept them once."""
    fleet = sshd_fleet(count, gpus_per_vm=1)
    for vm in fleet:
        vm.write_vm_env(OFFLINE)
    await fleet.register(db, entrypoint="training.train_grpo")
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    return fleet, poller


async def test_a_crashed_openssh_vm_costs_one_checkpoint_interval_and_the_model_comes_back(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    s3: S3Server,  # noqa: F811
) -> None:
    """Issue 22's crash-resume proof on two OpenSSH VMs (see `crash_resume_proof`)."""
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    fleet, poller = await training_fleet(sshd_fleet, db, transport, 2)
    for vm in fleet:
        s3.aws_files(vm.home)
    crashed: list[str] = []

    async def crash(name: str) -> None:
        vm = fleet.by_name(name)
        assert vm.processes(), "nothing runs on the VM to crash"
        vm.crash()
        assert not vm.running and not vm.processes() and not vm.sshd_pids()
        crashed.append(name)

    homes = {vm.name: vm.home for vm in fleet}
    job_id = await crash_resume_proof(db, nats, transport, poller, s3, tiny, tmp_path, homes, crash)
    assert len(crashed) == 1
    # `rlfleet job pull`, as a user runs it with the AWS variables of their machine.
    dest = tmp_path / "cli-pulled"
    env = dict(os.environ, RLFLEET_DATABASE_URL=db.url, **s3.env())
    pulled = subprocess.run(
        [str(RLFLEET), "job", "pull", str(job_id), str(dest), "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert s3.secret not in pulled.stdout + pulled.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dest)
    assert model.config.model_type == "qwen2"


async def test_a_hung_trainer_on_openssh_is_stopped_diagnosed_and_resumes_elsewhere(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
) -> None:
    """Issue 23's hang proof on two OpenSSH VMs. Given a trainer that checkpoints each step
    into an output directory both VMs mount and stops advancing after step 3 (its process
    alive, its GPU 100 % busy at low power: a hung collective) with a 10 s hang timeout,
    when it runs on vm0, then within 10 s and one poll of the poller first reading step 3
    it is failed as `hung`, its diagnostics (py-spy's stacks of the trainer, the GPU view,
    the log tail) are kept in the database and in the attempt directory on vm0, the kill
    sweep ends it over sshd, and the retry on vm1 resumes from checkpoint 3 and completes,
    with one retry used."""
    records = tmp_path / "records"
    records.mkdir()
    fleet = sshd_fleet(2, gpus_per_vm=1)
    for vm in fleet:
        vm.write_vm_env({"RLFLEET_FAKE_RECORD": str(records)})
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    job_id, done, diag, seen_at, detected_s = await hung_trainer_proof(
        db, nats.url, fleet, tmp_path / "shared-outputs", HANG_CONFIG, timeout=90
    )
    (first,) = attempt_dirs(fleet.by_name("vm0").home, await installation(db), job_id, 1)
    captured = datetime.fromtimestamp((first / "diagnostics.txt").stat().st_mtime, UTC)
    print(
        f"openssh: hang failed {detected_s:.2f}s after step 3 was first read (timeout 10s);"
        f" its diagnostics written at {(captured - seen_at).total_seconds():.2f}s"
    )
    # py-spy, run in the sshd session, attached to the trainer: its stack, down to the hang.
    assert "hang (" in diag.content and "fake_train.py:" in diag.content, diag.content[-3000:]
    assert diag.content in (first / "diagnostics.txt").read_text()
    runs = read_records(records)
    hung = next(r for r in runs if r["event"] == "hang")
    resumed = [r for r in runs if r["event"] == "resumed"]
    assert [(r["vm"], r["attempt"], r["from_step"]) for r in resumed] == [("vm1", "2", 3)]
    async with db.transaction() as session:
        (left,) = await session.scalars(select(Leftover).where(Leftover.job_id == job_id))
    assert left.killed_at is not None and left.reason == "hung"
    assert not Path(f"/proc/{hung['pid']}").exists(), "the hung trainer still runs"
    # Nothing started on vm0 outlives the test's sessions there (a poll's shell may take a
    # moment to end once its connection closed; the attempt would not end at all).
    deadline = time.monotonic() + 10
    while left_on_vm0 := {pid: _cmdline(pid) for pid in fleet.by_name("vm0").processes()}:
        assert time.monotonic() < deadline, left_on_vm0
        await asyncio.sleep(0.1)
    shown = rlfleet(db, "job", "logs", str(job_id), "--diagnostics")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"attempt 1 on vm0, captured {diag.captured_at}: hung: ")
    assert "fake_train.py:" in shown.stdout and "== nvidia-smi" in shown.stdout


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(ended)"


async def test_a_slow_trainer_on_openssh_is_never_stopped(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    nats: EmbeddedNats,
) -> None:
    """Given a trainer taking 5 s per step, its GPU idle-looking (80 W) so that only the
    progress decides, with a 10 s hang timeout, when it runs its 5 steps behind sshd, then
    it completes on its first attempt: no false stop."""
    fleet = sshd_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    fleet.by_name("vm0").set_busy_power(0, 80.0)
    async with daemons(db, nats.url, HANG_CONFIG):
        job_id = await new_job(db, 1, ("--fake_step_seconds", "5"), hang_timeout_s=10)
        done = await wait_status(db, job_id, {"completed", "failed"}, timeout=120)
    assert done.status == "completed", done.status_reason
    assert done.attempt == 1 and not await failed_events(db, job_id)


async def test_a_reward_server_killed_on_openssh_is_restarted_and_every_reward_is_scored(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Issue 23's role-restart proof on an OpenSSH VM (see `reward_restart_proof`): the
    example's reward role, killed mid-run, is restarted in place by its supervisor (which
    runs detached from any sshd session) while the trainer runs on and completes with
    every reward scored."""
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    fleet, poller = await training_fleet(sshd_fleet, db, transport, 1)
    await reward_restart_proof(db, nats, transport, poller, tiny, tmp_path, fleet)
