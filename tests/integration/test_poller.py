"""The GPU poller against real Postgres and real SSH servers (the simulated fleet)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import select, update

from scheduler.db import Database
from scheduler.gpu_poller import GpuPoller
from scheduler.gpu_poller.state import SweepStats
from scheduler.models import GPU, VM, JobEvent
from scheduler.transport import Transport
from tests.fleet import FAKE_TRAIN, SimFleet, SimVM
from tests.workloads.support import job_attempt_dir, job_row, launch_on


async def gpus_of(db: Database, vm_id: int) -> list[GPU]:
    async with db.transaction() as session:
        return list(
            await session.scalars(select(GPU).where(GPU.vm_id == vm_id).order_by(GPU.index))
        )


async def vm_row(db: Database, vm_id: int) -> VM:
    async with db.transaction() as session:
        return (await session.scalars(select(VM).where(VM.id == vm_id))).one()


async def launch_job(
    db: Database, transport: Transport, vm: SimVM, vm_id: int, gpu: int, *fake_args: str
) -> int:
    """A running job on `vm` holding GPU `gpu`, launched the way the dispatcher does."""
    return await launch_on(db, transport, vm.target(vm_id), gpu, *fake_args)


async def wait_for_exit_code(db: Database, vm: SimVM, job_id: int, timeout: float = 20) -> None:
    path = await job_attempt_dir(db, job_id, vm.home) / "exit_code"
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"job {job_id} never ended"
        await asyncio.sleep(0.1)


async def test_free_allocated_and_foreign_busy_gpus_are_recorded(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given a VM with three GPUs, polled once
    fleet: SimFleet = await sim_fleet(1, gpus_per_vm=3)
    ids = await fleet.register(db)
    vm_id = ids["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    assert [g.index for g in await gpus_of(db, vm_id)] == [0, 1, 2]
    assert (await vm_row(db, vm_id)).available_gpus == 3
    # When a job runs on GPU 1 and a process rlfleet did not start holds GPU 2
    job_id = await launch_job(db, transport, fleet[0], vm_id, 1, "--fake_seconds", "60")
    foreign = fleet[0].add_foreign_process(2)
    stats = await poller.sweep()
    # Then GPU 0 is free, GPU 1 is the job's (not foreign), GPU 2 is foreign-busy
    gpus = await gpus_of(db, vm_id)
    assert stats.reachable == 1 and stats.jobs_finished == 0
    assert [(g.job_id, g.foreign_busy, g.healthy) for g in gpus] == [
        (None, False, True),
        (job_id, False, True),
        (None, True, True),
    ]
    assert gpus[1].memory_used_mb and gpus[1].utilization_pct == 100
    assert gpus[0].uuid == fleet[0].gpu_uuids[0] and gpus[0].name == "NVIDIA A100-SXM4-80GB"
    vm = await vm_row(db, vm_id)
    assert (vm.status, vm.available_gpus, vm.last_error) == ("healthy", 1, None)
    assert vm.last_polled_at is not None and vm.last_seen_at is not None
    assert (await job_row(db, job_id)).status == "running"
    # And when the foreign process ends, its GPU is offered again; the job's GPU is not
    foreign.stop()
    await poller.sweep()
    gpus = await gpus_of(db, vm_id)
    assert [(g.job_id, g.foreign_busy) for g in gpus] == [
        (None, False),
        (job_id, False),
        (None, False),
    ]
    assert (await vm_row(db, vm_id)).available_gpus == 2


@pytest.mark.slow
async def test_a_process_left_on_a_finished_jobs_gpu_keeps_it_out_of_use(
    db: Database, sim_fleet, transport: Transport
) -> None:
    """Given a job whose GPU also holds another process (a child it left behind, or
    someone else's), when the job ends, then the sweep that frees its GPU marks it
    foreign-busy instead of offering it; once that process ends, the GPU is offered."""
    fleet: SimFleet = await sim_fleet(1, gpus_per_vm=2)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    job_id = await launch_job(db, transport, fleet[0], vm_id, 0, "--fake_seconds", "1")
    leftover = fleet[0].add_foreign_process(0)
    try:
        await poller.sweep()
        assert [(g.job_id, g.foreign_busy) for g in await gpus_of(db, vm_id)] == [
            (job_id, False),
            (None, False),
        ]
        await wait_for_exit_code(db, fleet[0], job_id)
        assert (await poller.sweep()).jobs_finished == 1
        assert (await job_row(db, job_id)).status == "completed"
        assert [(g.job_id, g.foreign_busy) for g in await gpus_of(db, vm_id)] == [
            (None, True),
            (None, False),
        ]
        assert (await vm_row(db, vm_id)).available_gpus == 1
    finally:
        leftover.stop()
    await poller.sweep()
    assert [(g.job_id, g.foreign_busy) for g in await gpus_of(db, vm_id)] == [
        (None, False),
        (None, False),
    ]
    assert (await vm_row(db, vm_id)).available_gpus == 2


async def test_a_vm_killed_mid_run_goes_unreachable_and_comes_back_healthy(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given two healthy VMs and a poller that gives up on a VM after 2 failed polls
    fleet: SimFleet = await sim_fleet(2, gpus_per_vm=2)
    ids = await fleet.register(db)
    poller = GpuPoller(db, transport, unreachable_after=2)
    await poller.sweep()
    assert (await vm_row(db, ids["vm0"])).status == "healthy"
    # When vm0 crashes
    await fleet[0].stop(kill_processes=True)
    await poller.sweep()
    # Then one failure is only counted (a blip is not an outage)…
    vm = await vm_row(db, ids["vm0"])
    assert (vm.status, vm.consecutive_failures) == ("healthy", 1)
    assert vm.unreachable_since is not None and "cannot connect" in (vm.last_error or "")
    first_failure = vm.unreachable_since
    # …and the second marks it unreachable with no GPU offered, while vm1 is untouched
    stats = await poller.sweep()
    assert (stats.failed, stats.reachable) == (1, 1)
    vm = await vm_row(db, ids["vm0"])
    assert (vm.status, vm.consecutive_failures, vm.available_gpus) == ("unreachable", 2, 0)
    assert vm.unreachable_since == first_failure
    assert not any(g.healthy for g in await gpus_of(db, ids["vm0"]))
    other = await vm_row(db, ids["vm1"])
    assert (other.status, other.available_gpus) == ("healthy", 2)
    # When it boots again on the same address, the next sweep sees it healthy
    await fleet[0].start()
    await poller.sweep()
    vm = await vm_row(db, ids["vm0"])
    assert (vm.status, vm.consecutive_failures, vm.unreachable_since, vm.last_error) == (
        "healthy",
        0,
        None,
        None,
    )
    assert vm.available_gpus == 2 and all(g.healthy for g in await gpus_of(db, ids["vm0"]))


async def test_finished_jobs_are_moved_with_exit_code_and_reason_and_free_their_gpus(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given a VM with five GPUs and five jobs that end in five different ways
    fleet: SimFleet = await sim_fleet(1, gpus_per_vm=5)
    vm = fleet[0]
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    ok = await launch_job(db, transport, vm, vm_id, 0)
    bad = await launch_job(db, transport, vm, vm_id, 1, "--fake_exit", "3")
    config = await launch_job(db, transport, vm, vm_id, 2, "--fake_exit", "64")
    oom = await launch_job(db, transport, vm, vm_id, 3, "--fake_oom_once")
    gone = await launch_job(db, transport, vm, vm_id, 4, "--fake_seconds", "60")
    for job_id in (ok, bad, config, oom):
        await wait_for_exit_code(db, vm, job_id)
    # (the last one is killed with its wrapper, as by a reboot: no exit code is written)
    pid = int((await job_attempt_dir(db, gone, vm.home) / "pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    await wait_dead(pid)
    # When the poller sweeps
    stats = await poller.sweep()
    # Then each job is in its end state with its exit code and failure reason
    assert stats.jobs_finished == 5
    seen = {}
    for job_id in (ok, bad, config, oom, gone):
        job = await job_row(db, job_id)
        seen[job_id] = (job.status, job.exit_code, job.failure_reason)
    assert seen == {
        ok: ("completed", 0, None),
        bad: ("failed", 3, "exit_nonzero"),
        config: ("failed", 64, "config_error"),
        oom: ("failed", 75, "oom"),
        gone: ("failed", None, "vanished"),
    }
    # And their GPUs are free again, the move recorded as the poller's
    assert all(g.job_id is None for g in await gpus_of(db, vm_id))
    assert (await vm_row(db, vm_id)).available_gpus == 5
    async with db.transaction() as session:
        actors = set(
            await session.scalars(
                select(JobEvent.actor).where(JobEvent.to_status.in_(["completed", "failed"]))
            )
        )
    assert actors == {"poller"}
    # And a second sweep changes nothing (a finished job is not moved twice)
    assert (await poller.sweep()).jobs_finished == 0


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("driver", "cannot reach the NVIDIA driver"),
        ("no_devices", "no devices were found"),
        ("garbage", "unreadable nvidia-smi GPU line"),
    ],
)
async def test_every_nvidia_smi_failure_marks_the_vm_unhealthy_and_the_poller_goes_on(
    db: Database, sim_fleet, transport: Transport, mode: str, reason: str
) -> None:
    # Given two healthy VMs with two GPUs each, and a job running on vm0's GPU 0
    fleet: SimFleet = await sim_fleet(2, gpus_per_vm=2)
    ids = await fleet.register(db)
    poller = GpuPoller(db, transport)
    await poller.sweep()
    job_id = await launch_job(db, transport, fleet[0], ids["vm0"], 0, "--fake_seconds", "60")
    # When vm0's nvidia-smi fails
    fleet[0].fail_nvidia_smi(mode)
    stats = await poller.sweep()
    # Then vm0 is unhealthy with the reason, none of its GPUs offered, the job left alone
    assert stats.unhealthy == 1
    vm = await vm_row(db, ids["vm0"])
    assert vm.status == "unhealthy" and reason in (vm.last_error or "")
    assert (vm.available_gpus, vm.consecutive_failures) == (0, 0)
    gpus = await gpus_of(db, ids["vm0"])
    assert not any(g.healthy for g in gpus) and gpus[0].job_id == job_id
    assert (await job_row(db, job_id)).status == "running"
    # And the other VM is polled as usual
    assert (await vm_row(db, ids["vm1"])).status == "healthy"
    # When nvidia-smi works again, the VM is healthy again
    fleet[0].fail_nvidia_smi(None)
    await poller.sweep()
    vm = await vm_row(db, ids["vm0"])
    assert (vm.status, vm.last_error, vm.available_gpus) == ("healthy", None, 1)


async def test_a_host_key_mismatch_is_a_failed_poll_and_no_command_runs(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given a VM registered with another VM's host key in its known_hosts
    fleet: SimFleet = await sim_fleet(2)
    ids = await fleet.register(db)
    impostor_key = fleet[1].known_hosts_path.read_text().split(" ", 1)[1]
    fleet[0].known_hosts_path.write_text(f"[127.0.0.1]:{fleet[0].port} {impostor_key}")
    # When the poller sweeps
    await GpuPoller(db, transport).sweep()
    # Then the VM counts a failure that says why, and has no GPU rows
    vm = await vm_row(db, ids["vm0"])
    assert vm.consecutive_failures == 1 and "host key" in (vm.last_error or "")
    assert await gpus_of(db, ids["vm0"]) == []


@pytest.mark.slow
async def test_the_poller_daemon_runs_from_the_command_line(
    database_url: str, db: Database, sim_fleet
) -> None:
    # Given a registered VM
    fleet: SimFleet = await sim_fleet(1, gpus_per_vm=2)
    vm_id = (await fleet.register(db))["vm0"]
    # When `python -m scheduler.gpu_poller` runs for a while
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scheduler.gpu_poller",
            "--interval",
            "0.5",
            "--database-url",
            database_url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while (await vm_row(db, vm_id)).status != "healthy":
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the poller never polled the VM"
            await asyncio.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=20)
    # Then it recorded the VM's GPUs and stopped cleanly on SIGTERM
    assert (await vm_row(db, vm_id)).available_gpus == 2
    assert proc.returncode == 0, err.decode()


async def wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Until `pid` is gone or a zombie (nobody may reap it here), as the probe judges it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, IndexError):
            return
        if state == "Z":
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"process {pid} still alive after SIGKILL")


async def test_a_poll_that_predates_a_broken_launch_does_not_undo_its_mark(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, transport: Transport
) -> None:
    """A poll can land after a newer one (polls in flight outlive their sweep). Given a
    poll of a healthy VM that is still out, when meanwhile an attempt there fails to start
    (the VM is marked with launch_error), then that older poll's answer, which ran no
    check of python, leaves the mark and the VM unhealthy. (This interleaving happens by
    chance with the real loop; the test drives the poller's load, probe and apply steps
    in that order to make it happen every time.)"""
    fleet: SimFleet = await sim_fleet(1, gpus_per_vm=1)
    vm_id = (await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=sys.executable))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    (state,) = await poller._load()
    older = await poller._probe(state)  # sent before the mark: no check in it
    mark = "launch_failed: exit 126: python: Permission denied"
    async with db.transaction() as session:
        await session.execute(
            update(VM)
            .where(VM.id == vm_id)
            .values(launch_error=mark, last_error=mark, status="unhealthy")
        )
    await poller._apply([older], SweepStats())
    vm = await vm_row(db, vm_id)
    assert (vm.status, vm.launch_error, vm.last_error) == ("unhealthy", mark, mark)
    # And the next poll checks python (the fake one runs): the mark is lifted then.
    await poller.sweep()
    vm = await vm_row(db, vm_id)
    assert (vm.status, vm.launch_error) == ("healthy", None)


async def test_a_poll_left_running_by_one_sweep_and_the_next_sweeps_poll_land_together(
    db: Database, sim_fleet, transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a polled VM, and a sweep that ends before its poll lands (the daemon's deadline)
    fleet: SimFleet = await sim_fleet(1, gpus_per_vm=2)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    # (a process appears on GPU 1, so that both late polls have a GPU row to change)
    foreign = fleet[0].add_foreign_process(1)
    await poller.sweep(wait_s=0.0)
    deadline = time.monotonic() + 20
    while poller.in_flight:
        assert time.monotonic() < deadline, "the left poll never landed"
        await asyncio.sleep(0.05)
    # When the next sweep writes that late poll in one batch with its own poll of the VM
    # (a long flush window makes the two land in one batch on any machine)
    monkeypatch.setattr("scheduler.gpu_poller.sweep.FLUSH_AFTER_S", 30.0)
    stats = await poller.sweep()
    # Then the batch is written (each GPU row once), not refused by Postgres
    assert stats.reachable == 1
    assert [(g.index, g.foreign_busy) for g in await gpus_of(db, vm_id)] == [(0, False), (1, True)]
    assert (await vm_row(db, vm_id)).status == "healthy"
    foreign.stop()
