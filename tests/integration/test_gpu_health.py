"""GPU health on the SSH fleet with the simulated nvidia-smi reporting ECC counts, pending
retirement and remapping, `[GPU requires reset]` / `[Unknown Error]` and a GPU that
vanishes: each makes that GPU (not the VM) unhealthy with a reason and an event, no job is
placed on it, a job on a GPU that can no longer compute moves elsewhere without using a
retry, one on a GPU with rising ECC is left to finish, and a GPU is healthy again only
after its condition has been clear for `gpu_health.CLEAR_POLLS` polls."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import select, update

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_health import CLEAR_POLLS
from scheduler.gpu_poller import GpuPoller
from scheduler.gpu_poller.inventory import apply
from scheduler.gpu_poller.state import Outcome, SweepStats
from scheduler.gpu_poller.sweep import load_vms
from scheduler.models import GPU, VM, GpuEvent, Job, JobEvent, JobNode
from scheduler.poll import parse_poll, poll_command
from scheduler.requeue import RequeueConfig
from scheduler.transport import Transport
from tests.fleet import FAKE_TRAIN, SimFleet
from tests.integration.test_poller import wait_for_exit_code
from tests.workloads.support import (
    RLFLEET,
    alive,
    daemons,
    job_nodes,
    job_row,
    launch_on,
    new_job,
    scheduling,
    wait_status,
    write_fake_python,
)

# Every test here polls a fleet over SSH several times: seconds each.
pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, recheck_after_s=0.3)


async def gpu_rows(db: Database, vm_id: int) -> dict[str, GPU]:
    """The VM's GPU rows by UUID."""
    async with db.transaction() as session:
        rows = await session.scalars(select(GPU).where(GPU.vm_id == vm_id))
        return {g.uuid: g for g in rows}


async def events(db: Database, vm_id: int) -> list[tuple[int | None, str, str]]:
    """The VM's GPU events, oldest first: (index, kind, reason)."""
    async with db.transaction() as session:
        rows = await session.execute(
            select(GpuEvent.gpu_index, GpuEvent.kind, GpuEvent.reason)
            .where(GpuEvent.vm_id == vm_id)
            .order_by(GpuEvent.id)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


async def wait_gpu(db: Database, vm_id: int, uuid: str, healthy: bool, timeout: float = 30) -> GPU:
    deadline = time.monotonic() + timeout
    while (row := (await gpu_rows(db, vm_id))[uuid]).healthy != healthy:
        assert time.monotonic() < deadline, f"GPU {uuid} never became healthy={healthy}"
        await asyncio.sleep(0.05)
    return row


def rlfleet(db: Database, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI, as a user runs it."""
    env = dict(os.environ, RLFLEET_DATABASE_URL=db.url)
    return subprocess.run(
        [str(RLFLEET), *args], env=env, capture_output=True, text=True, timeout=60
    )


async def placements_on(db: Database, job_ids: list[int], uuids: set[str]) -> int:
    """How many placements (a rank of an attempt, `job_nodes`) of these jobs name one of
    `uuids`: what "placements on unhealthy GPUs" counts."""
    async with db.transaction() as session:
        placed = await session.scalars(select(JobNode.gpu_uuids).where(JobNode.job_id.in_(job_ids)))
        return sum(1 for gpus in placed if set(gpus or ()) & uuids)


async def test_rising_ecc_keeps_new_jobs_off_but_leaves_the_running_one_and_a_reset_clears_it(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    # Given a VM with two GPUs and a job running on GPU 0
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm = fleet[0]
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    vm.set_gpu_health(0, ecc=1)  # an old error: the baseline, not a rise
    await poller.sweep()
    job_id = await launch_on(db, transport, vm.target(vm_id), 0, "--fake_seconds", "3")
    await poller.sweep()
    u0, u1 = vm.gpu_uuids
    assert (await gpu_rows(db, vm_id))[u0].healthy
    # When its uncorrected ECC count rises
    vm.set_gpu_health(0, ecc=4)
    await poller.sweep()
    # Then the GPU is unhealthy with the reason and an event, the VM itself healthy…
    row = (await gpu_rows(db, vm_id))[u0]
    assert not row.healthy and row.health_reason == "uncorrected ECC errors rose from 1 to 4"
    assert (await events(db, vm_id)) == [
        (0, "unhealthy", "uncorrected ECC errors rose from 1 to 4")
    ]
    async with db.transaction() as session:
        vm_row = await session.get(VM, vm_id)
        assert vm_row is not None and (vm_row.status, vm_row.available_gpus) == ("healthy", 1)
    # …and the job on it is left to run
    job = await job_row(db, job_id)
    assert (job.status, job.attempt) == ("running", 1)
    # When the job ends, it has completed; its GPU is still not offered while the count
    # stays up
    await wait_for_exit_code(db, vm, job_id)
    await poller.sweep()
    assert (await job_row(db, job_id)).status == "completed"
    await poller.sweep()
    async with db.transaction() as session:
        vm_row = await session.get(VM, vm_id)
        assert vm_row is not None and vm_row.available_gpus == 1
    # When a reset brings the volatile count back to 0, it is healthy again only after
    # CLEAR_POLLS polls in a row
    vm.set_gpu_health(0, ecc=0)
    for _ in range(CLEAR_POLLS - 1):
        await poller.sweep()
        row = (await gpu_rows(db, vm_id))[u0]
        assert not row.healthy
    await poller.sweep()
    row = (await gpu_rows(db, vm_id))[u0]
    assert row.healthy and row.health_reason is None
    assert (await events(db, vm_id))[-1][:2] == (0, "healthy")
    assert (await gpu_rows(db, vm_id))[u1].healthy, "the other GPU was never touched"


async def test_a_gpu_that_requires_reset_stops_its_job_and_not_the_vms_other_jobs(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    # Given two jobs on two GPUs of one VM
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm = fleet[0]
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    broken = await launch_on(db, transport, vm.target(vm_id), 0, "--fake_seconds", "60")
    fine = await launch_on(db, transport, vm.target(vm_id), 1, "--fake_seconds", "60")
    await poller.sweep()
    # When GPU 0 requires a reset
    vm.set_gpu_health(0, fault="[GPU requires reset]")
    await poller.sweep()
    # Then its job failed as a machine fault (no retry used), the other still runs
    job = await job_row(db, broken)
    assert (job.status, job.failure_reason, job.retry_count) == ("failed", "gpu_failed", 0)
    assert job.status_reason is not None and "requires reset" in job.status_reason
    assert (await job_row(db, fine)).status == "running"
    rows = await gpu_rows(db, vm_id)
    assert not rows[vm.gpu_uuids[0]].healthy and rows[vm.gpu_uuids[0]].job_id is None
    assert rows[vm.gpu_uuids[1]].healthy and rows[vm.gpu_uuids[1]].job_id == fine
    # And a second poll does not stop anything again
    await poller.sweep()
    assert (await job_row(db, fine)).status == "running"
    async with db.transaction() as session:
        failed = await session.scalar(
            select(JobEvent.id).where(JobEvent.job_id == fine, JobEvent.to_status == "failed")
        )
    assert failed is None


async def test_no_job_is_placed_on_an_unhealthy_gpu(
    db: Database, sim_fleet: FleetFactory, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given a VM of six GPUs, five of which turn unhealthy in five different ways and one
    that answers [N/A] for its health fields, when six jobs are submitted, then exactly
    one runs, on the healthy GPU, and no placement names an unhealthy one; once the
    rising ECC is reset and clear for CLEAR_POLLS polls, a job is placed on that GPU."""
    fleet = await sim_fleet(1, gpus_per_vm=6)
    vm = fleet[0]
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    vm_id = ids["vm0"]
    uuids = vm.gpu_uuids
    async with daemons(db, nats.url, CONFIG):
        deadline = time.monotonic() + 30
        while len(await gpu_rows(db, vm_id)) < 6:
            assert time.monotonic() < deadline, "the poller never listed the GPUs"
            await asyncio.sleep(0.05)
        vm.set_gpu_health(0, ecc=2)
        vm.set_gpu_health(1, retired_pending=True)
        vm.set_gpu_health(2, remapped_pending=True)
        vm.set_gpu_health(3, fault="[Unknown Error]")
        vm.set_gpu_health(4, vanished=True)
        vm.set_gpu_health(5, unsupported=True)
        for uuid in uuids[:5]:
            await wait_gpu(db, vm_id, uuid, healthy=False)
        rows = await gpu_rows(db, vm_id)
        reasons = [rows[u].health_reason or "" for u in uuids]
        assert reasons[0] == "uncorrected ECC errors rose from 0 to 2"
        assert reasons[1].startswith("page retirement pending")
        assert reasons[2].startswith("row remapping pending")
        assert reasons[3] == "reports an error: nvidia-smi prints [Unknown Error]"
        assert reasons[4] == "lost: no longer listed by nvidia-smi"
        assert rows[uuids[5]].healthy, "[N/A] health fields are not a sign of trouble"

        jobs = [await new_job(db, 1, ("--fake_seconds", "60")) for _ in range(6)]
        # Whichever job the dispatcher takes first (they are announced in no set order)
        # runs on the one healthy GPU
        deadline = time.monotonic() + 30
        while not (running := [j for j in jobs if (await job_row(db, j)).status == "running"]):
            assert time.monotonic() < deadline, "no job ran on the healthy GPU"
            await asyncio.sleep(0.05)
        first = await job_row(db, running[0])
        assert first.gpu_uuids == [uuids[5]]
        # Every other job waits: give the dispatcher and requeue manager several rounds.
        for _ in range(10):
            await asyncio.sleep(0.2)
            assert await placements_on(db, jobs, set(uuids[:5])) == 0
        # …never claimed at all (a claim on an unhealthy GPU that failed and was requeued
        # would have left attempt 1 behind)
        waiting = [await job_row(db, j) for j in jobs if j != first.id]
        assert {(j.status, j.attempt) for j in waiting} <= {("queued", 0), ("pending", 0)}

        # When GPU 0 is reset (its volatile ECC count back to 0), it is healthy again after
        # CLEAR_POLLS polls and a waiting job is placed there
        vm.set_gpu_health(0, ecc=0)
        await wait_gpu(db, vm_id, uuids[0], healthy=True)
        deadline = time.monotonic() + 30
        while True:
            async with db.transaction() as session:
                on_zero = await session.scalar(
                    select(Job.id).where(Job.gpu_uuids == [uuids[0]], Job.status == "running")
                )
            if on_zero is not None:
                break
            assert time.monotonic() < deadline, "no job was placed on the healed GPU"
            await asyncio.sleep(0.05)
        assert await placements_on(db, jobs, set(uuids[1:5])) == 0
    kinds = [(i, k) for i, k, _ in await events(db, vm_id)]
    assert kinds[:5] == [(i, "unhealthy") for i in range(5)] or sorted(kinds[:5]) == [
        (i, "unhealthy") for i in range(5)
    ]
    assert (0, "healthy") in kinds


async def test_a_job_on_a_gpu_that_requires_reset_moves_elsewhere_without_using_a_retry(
    db: Database, sim_fleet: FleetFactory, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given two VMs, the second drained at first so the job lands on the first, when the
    job's GPU reports [GPU requires reset], then its attempt is stopped (its process
    killed), the job fails as gpu_failed and runs to completion on the other VM with
    retry_count 0; `vm show` and `vm list --json` say which GPU is unhealthy and why."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.name == "vm1").values(draining=True))
    async with daemons(db, nats.url, CONFIG):
        job_id = await new_job(db, 1, ("--fake_seconds", "4"), max_retries=0)
        first = await wait_status(db, job_id, "running", timeout=30)
        assert first.vm_id == ids["vm0"] and first.remote_pid is not None
        pid = first.remote_pid
        fleet[0].set_gpu_health(0, fault="[GPU requires reset]")
        async with db.transaction() as session:
            await session.execute(update(VM).where(VM.name == "vm1").values(draining=False))
        done = await wait_status(db, job_id, "completed", timeout=60)
        assert done.vm_id == ids["vm1"] and done.attempt == 2 and done.exit_code == 0
        assert (done.retry_count, done.max_retries) == (0, 0)
        assert not alive(pid), "the stopped attempt's process was killed"
    async with db.transaction() as session:
        failed = (
            await session.scalars(
                select(JobEvent.reason).where(
                    JobEvent.job_id == job_id, JobEvent.to_status == "failed"
                )
            )
        ).all()
    assert len(failed) == 1 and failed[0].startswith("gpu_failed: GPU 0 ("), failed
    assert "requires reset" in failed[0]

    shown = rlfleet(db, "vm", "show", "vm0", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert data["status"] == "healthy"
    assert [(g["state"], g["healthy"]) for g in data["gpus"]] == [("unhealthy", False)]
    assert "requires reset" in data["gpus"][0]["health_reason"]
    assert data["gpu_events"][0]["kind"] == "unhealthy"
    text = rlfleet(db, "vm", "show", "vm0")
    assert "requires reset" in text.stdout and "GPU EVENT AT" in text.stdout
    listed = json.loads(rlfleet(db, "vm", "list", "--json").stdout)
    by_name = {v["name"]: v for v in listed}
    assert "requires reset" in by_name["vm0"]["gpus"][0]["health_reason"]
    assert by_name["vm1"]["gpus"][0]["health_reason"] is None


async def test_vm_drain_gpu_takes_one_gpu_out_by_hand_and_undrain_brings_it_back(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    # Given a polled VM with two free GPUs
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    u0, u1 = fleet[0].gpu_uuids

    async def free() -> int:
        async with db.transaction() as session:
            row = await session.get(VM, vm_id)
            assert row is not None
            return row.available_gpus

    assert await free() == 2
    # When an operator drains GPU 1 by index
    out = rlfleet(db, "vm", "drain", "vm0", "--gpu", "1")
    assert out.returncode == 0, out.stderr
    assert u1 in out.stdout
    # Then it is drained, not offered, and a poll does not undo it
    await poller.sweep()
    rows = await gpu_rows(db, vm_id)
    assert rows[u1].drained and rows[u1].healthy and not rows[u0].drained
    assert await free() == 1
    # When undrained by UUID prefix, it is offered again
    out = rlfleet(db, "vm", "undrain", "vm0", "--gpu", u1[:13])
    assert out.returncode == 0, out.stderr
    assert not (await gpu_rows(db, vm_id))[u1].drained and await free() == 2
    assert [(i, k) for i, k, _ in await events(db, vm_id)] == [(1, "drained"), (1, "undrained")]
    # An unknown GPU, or an unknown VM, is bad input: exit 2, one line, nothing changed
    for args in (["vm0", "--gpu", "7"], ["vm0", "--gpu", "GPU-nope-nope"], ["vmX", "--gpu", "0"]):
        bad = rlfleet(db, "vm", "drain", *args)
        assert bad.returncode == 2, bad
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert not any(g.drained for g in (await gpu_rows(db, vm_id)).values())


async def test_absurd_numbers_from_one_vm_cost_only_that_vm(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    """Given two VMs, one whose nvidia-smi prints an ECC count no column holds, when the
    poller sweeps, then that VM's GPUs cannot be trusted (one-line reason)
    and the other VM is recorded as usual: one VM's output never fails the batch."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    ids = await fleet.register(db)
    fleet[0].set_gpu_health(0, ecc=10**20)
    poller = GpuPoller(db, transport)
    stats = await poller.sweep()
    assert stats.reachable == 2
    async with db.transaction() as session:
        bad = await session.get(VM, ids["vm0"])
        good = await session.get(VM, ids["vm1"])
    assert bad is not None and good is not None
    assert bad.status == "unhealthy" and "out of range" in (bad.last_error or "")
    assert (good.status, good.available_gpus) == ("healthy", 1)


async def test_a_gpu_that_vanishes_again_while_clearing_starts_its_count_again(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    # Given a GPU that vanished and came back, clear for CLEAR_POLLS - 1 polls
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    uuid = fleet[0].gpu_uuids[1]
    fleet[0].set_gpu_health(1, vanished=True)
    await poller.sweep()
    fleet[0].set_gpu_health(1, vanished=None)
    for _ in range(CLEAR_POLLS - 1):
        await poller.sweep()
    assert (await gpu_rows(db, vm_id))[uuid].health_clear_polls == CLEAR_POLLS - 1
    # When it vanishes again for one poll, then comes back
    fleet[0].set_gpu_health(1, vanished=True)
    await poller.sweep()
    assert (await gpu_rows(db, vm_id))[uuid].health_clear_polls == 0
    fleet[0].set_gpu_health(1, vanished=None)
    # Then it takes CLEAR_POLLS polls again, not one
    for _ in range(CLEAR_POLLS - 1):
        await poller.sweep()
        assert not (await gpu_rows(db, vm_id))[uuid].healthy
    await poller.sweep()
    assert (await gpu_rows(db, vm_id))[uuid].healthy


async def test_a_gpu_fallen_off_the_bus_is_lost_alone_and_its_job_moves(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    """Given jobs on both GPUs of a VM, when GPU 0 falls off the bus (nvidia-smi says it
    is lost, lists GPU 1 and exits 15), then the VM stays healthy, GPU 0 alone is lost and
    its job stopped as gpu_failed, and the job on GPU 1 runs on."""
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm = fleet[0]
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    on_lost = await launch_on(db, transport, vm.target(vm_id), 0, "--fake_seconds", "60")
    on_fine = await launch_on(db, transport, vm.target(vm_id), 1, "--fake_seconds", "60")
    await poller.sweep()
    vm.fail_nvidia_smi("fallen_off_bus")
    await poller.sweep()
    async with db.transaction() as session:
        row = await session.get(VM, vm_id)
        assert row is not None and (row.status, row.last_error) == ("healthy", None)
    rows = await gpu_rows(db, vm_id)
    lost, fine = (rows[u] for u in vm.gpu_uuids)
    assert not lost.healthy and lost.health_reason == "lost: no longer listed by nvidia-smi"
    assert fine.healthy and fine.job_id == on_fine
    job = await job_row(db, on_lost)
    assert (job.status, job.failure_reason, job.retry_count) == ("failed", "gpu_failed", 0)
    assert (await job_row(db, on_fine)).status == "running"


async def test_a_rank_on_a_gpu_that_requires_reset_stops_the_whole_attempt_which_runs_again(
    db: Database, sim_fleet: FleetFactory, nats: EmbeddedNats, transport: Transport, tmp_path: Path
) -> None:
    """Given a 2 × 1 job on two of three VMs, when rank 1's GPU requires a reset, then the
    job fails as gpu_failed (no retry used), rank 0 on its healthy VM is killed rather than
    left running alone, and the job runs again as a whole on the two healthy VMs."""
    fleet = await sim_fleet(3, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    by_id = {vm_id: fleet.by_name(name) for name, vm_id in ids.items()}
    poller = GpuPoller(db, transport)
    await poller.sweep()
    job_id = await new_job(
        db, 1, ("--fake_seconds", "300", "--fake_retry_seconds", "1"), nodes=2, max_retries=0
    )
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await requeue.tick()
        await wait_status(db, job_id, "running")
        first = await job_nodes(db, job_id)
        rank0_pid, broken_vm = first[0].remote_pid, first[1].vm_id
        assert rank0_pid is not None and alive(rank0_pid) and broken_vm is not None
        by_id[broken_vm].set_gpu_health(0, fault="[GPU requires reset]")
        await poller.sweep()
        job = await job_row(db, job_id)
        assert (job.status, job.failure_reason, job.retry_count) == ("failed", "gpu_failed", 0)
        deadline = time.monotonic() + 30
        while alive(rank0_pid):  # the requeue manager's kill sweep
            assert time.monotonic() < deadline, "rank 0 was left running alone"
            await requeue.tick()
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + 60
        while (job := await job_row(db, job_id)).status != "completed":
            assert time.monotonic() < deadline, f"job is {job.status} ({job.status_reason})"
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(0.1)
        second = await job_nodes(db, job_id)
    assert job.attempt == 2 and job.retry_count == 0
    assert broken_vm not in {r.vm_id for r in second}


async def test_a_poll_that_lands_sweeps_later_steps_from_the_gpus_current_health(
    db: Database, sim_fleet: FleetFactory, transport: Transport
) -> None:
    """Given a poll sent by a sweep that loaded the VM before its GPU rows existed (a slow
    poll lands sweeps later), when it reports an ECC count that rose since the GPU was
    first recorded, then the rise is seen: the step is taken from the row as it is when
    the poll is written, not from the stale load (which would take 2 for a first sight)."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    vm_id = (await fleet.register(db))["vm0"]
    async with db.transaction() as session:
        stale = (await load_vms(session))[vm_id]
    assert stale.gpus == {}
    await GpuPoller(db, transport).sweep()  # the rows, with 0 errors
    fleet[0].set_gpu_health(0, ecc=2)
    answer = await transport.run(stale.target, poll_command([]), timeout=30)
    await apply(
        db,
        [Outcome(stale, result=parse_poll(answer.stdout))],
        SweepStats(),
        unreachable_after=3,
        unreachable_timeout=8,
    )
    row = (await gpu_rows(db, vm_id))[fleet[0].gpu_uuids[0]]
    assert not row.healthy and row.health_reason == "uncorrected ECC errors rose from 0 to 2"
