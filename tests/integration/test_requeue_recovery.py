"""Recovery from lost VMs with every real piece: SSH test fleet, the poller, the
dispatcher, NATS, Postgres and the requeue manager. Only the GPUs are simulated.

A VM is "lost" by closing its SSH server while its processes live on (a network
partition): the job must be retried elsewhere, resume there, and its first process must be
killed as soon as the VM answers again, before its GPU is offered to anyone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import select

from scheduler.claims.batch import claim_gpus
from scheduler.claims.result import Claim, NoClaim
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.jobs import transition
from scheduler.models import GPU, VM, JobEvent, Leftover
from scheduler.remote.launch import FENCED_EXIT, LaunchSpec, launch_script
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.states import JobStatus
from scheduler.transport import Transport, VMTarget
from tests.backdate import age_lease, age_outages
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    alive,
    job_attempt_dir,
    new_job,
    running_dispatcher,
    sweep_until,
    wait_file,
    wait_status,
    write_fake_python,
)

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, node_lost_timeout_s=2.0, recheck_after_s=0.5)


async def fleet_of(
    sim_fleet: FleetFactory, db: Database, tmp_path: Path, n: int
) -> tuple[SimFleet, dict[str, int]]:
    """`n` one-GPU VMs, registered to run fake_train."""
    fleet = await sim_fleet(n, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    return fleet, ids


@pytest.mark.slow
async def test_a_job_on_a_lost_vm_resumes_elsewhere_and_its_leftover_is_killed(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Given a job running on one of two VMs, when that VM drops off the network for
    longer than the node-lost timeout, then the job fails as node_lost and runs again on
    the other VM with `--resume auto` and no retry used up; when the lost VM comes back,
    its old process is killed before its GPU can be claimed again."""
    fleet, ids = await fleet_of(sim_fleet, db, tmp_path, 2)
    by_id = {vm_id: fleet.by_name(name) for name, vm_id in ids.items()}
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(db, 1, ("--fake_seconds", "300"), max_retries=0)
    nc = await nats_client.connect(nats.url)
    requeue = RequeueManager(db, NatsPublisher(nc), transport, CONFIG)
    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            await requeue.tick()  # announces the job nobody published
            first = await wait_status(db, job_id, "running")
            lost_vm, lost_pid = by_id[first.vm_id], first.remote_pid
            assert lost_pid is not None

            # The VM drops off the network; its processes live on.
            await lost_vm.stop()
            await sweep_until(poller, db, first.vm_id, "unreachable")
            await age_outages(db, CONFIG.node_lost_timeout_s + 1)
            report = await requeue.tick()
            assert report.node_lost == [job_id] and report.retried == [job_id]

            second = await wait_status(db, job_id, "running")
            assert second.vm_id != first.vm_id and second.attempt == first.attempt + 1
            assert (second.retry_count, second.max_retries) == (0, 0)
            assert alive(lost_pid), "the partitioned VM's process lives on meanwhile"
            new_vm = by_id[second.vm_id]
            log = await wait_file(
                await job_attempt_dir(db, job_id, new_vm.home) / "train.log",
                needle="fake_train: args=",
            )
            assert "'--resume', 'auto'" in log
            assert first.attempt_dir is not None
            first_log = (Path(first.attempt_dir) / "train.log").read_text()
            assert "--resume" not in first_log

            # The VM answers again: its GPU stays out of use until the leftover is dead.
            await lost_vm.start()
            await sweep_until(poller, db, first.vm_id, "healthy")
            probe = await new_job(db, 1)
            refused = await claim_gpus(db, probe, actor="test")
            assert isinstance(refused, NoClaim)
            report = await requeue.tick()
            assert report.killed == [job_id]
            assert not alive(lost_pid)
            await poller.sweep()
            async with db.transaction() as session:
                assert await transition(
                    session,
                    probe,
                    expected=JobStatus.PENDING,
                    to=JobStatus.QUEUED,
                    reason="test",
                    actor="test",
                )
            taken = await claim_gpus(db, probe, actor="test")
            assert isinstance(taken, Claim) and taken.vm_id == first.vm_id
    finally:
        await nc.close()

    async with db.transaction() as session:
        stale = (await session.execute(select(Leftover))).scalars().all()
        moves = (
            await session.execute(
                select(JobEvent.from_status, JobEvent.to_status, JobEvent.attempt)
                .where(JobEvent.job_id == job_id)
                .order_by(JobEvent.id)
            )
        ).all()
    assert [(s.job_id, s.attempt, s.killed_at is not None) for s in stale] == [
        (job_id, first.attempt, True)
    ]
    assert [tuple(m) for m in moves] == [
        (None, "queued", 0),
        ("queued", "starting", 1),
        ("starting", "running", 1),
        ("running", "failed", 1),
        ("failed", "queued", 1),
        ("queued", "starting", 2),
        ("starting", "running", 2),
    ]


@pytest.mark.slow
async def test_a_short_ssh_blip_never_restarts_a_healthy_job(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Given a running job, when its VM is unreachable for less than the node-lost
    timeout and then answers again, the job keeps running as the same attempt."""
    fleet, ids = await fleet_of(sim_fleet, db, tmp_path, 1)
    vm_id = ids[fleet[0].name]
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(db, 1, ("--fake_seconds", "300"))
    nc = await nats_client.connect(nats.url)
    requeue = RequeueManager(db, NatsPublisher(nc), transport, CONFIG)
    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            await requeue.tick()
            before = await wait_status(db, job_id, "running")
            await fleet[0].stop()
            await sweep_until(poller, db, vm_id, "unreachable")
            await requeue.tick()
            await asyncio.sleep(0.5)
            await fleet[0].start()
            await sweep_until(poller, db, vm_id, "healthy")
            for _ in range(3):
                report = await requeue.tick()
                assert report.node_lost == []
            # Long after the blip, too: no outage left to count.
            await age_outages(db, CONFIG.node_lost_timeout_s + 1)
            assert (await requeue.tick()).node_lost == []
            after = await wait_status(db, job_id, "running")
    finally:
        await nc.close()
    assert (after.attempt, after.remote_pid, after.vm_id) == (
        before.attempt,
        before.remote_pid,
        before.vm_id,
    )
    async with db.transaction() as session:
        gpus = (await session.execute(select(GPU.job_id))).scalars().all()
    assert gpus == [job_id]


async def test_a_launch_that_outlives_its_lease_is_fenced_off(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Given a claim whose lease runs out while its launch is still on its way (a slow
    link, a stalled dispatcher), the requeue manager takes the claim back and kills the
    attempt before anything ran: the kill fences the attempt off, so when the late launch
    arrives it starts nothing, and the job can never run twice."""
    fleet, _ = await fleet_of(sim_fleet, db, tmp_path, 1)
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(db, 1, ("--fake_seconds", "30"))
    claim = await claim_gpus(db, job_id, actor="stalled-dispatcher", lease_s=0.1)
    assert isinstance(claim, Claim)
    await age_lease(db, job_id, 1)  # as a second later: the lease has run out
    nc = await nats_client.connect(nats.url)
    try:
        report = await RequeueManager(db, NatsPublisher(nc), transport, CONFIG).tick()
    finally:
        await nc.close()
    assert report.expired == [job_id] and report.killed == [job_id]

    async with db.transaction() as session:
        vm = (await session.execute(select(VM).where(VM.id == claim.vm_id))).scalar_one()
        target = VMTarget.from_vm(vm)
        stale = (await session.execute(select(Leftover))).scalars().one()
    assert (stale.reason, stale.attempt, stale.killed_at is not None) == (
        "lease_expired",
        claim.attempt,
        True,
    )
    assert stale.launch_token == claim.token
    late = LaunchSpec(
        run=claim.attempt_ref,
        python=target.python,
        entrypoint=target.entrypoint,
        gpu_indices=claim.gpu_indices,
        model="m",
        dataset="d",
        reward_functions=("format",),
        output_dir=claim.output_dir,
        extra_args=("--fake_seconds", "30"),
    )
    result = await transport.run(target, launch_script(late), timeout=20)
    assert result.exit_status == FENCED_EXIT, result.stderr
    attempt_dir = fleet[0].home / claim.attempt_ref.relative
    assert not (attempt_dir / "pid").exists() and not (attempt_dir / "train.log").exists()
