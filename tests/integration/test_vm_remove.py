"""`rlfleet vm remove` tells the truth, with the real CLI, SSH fleet, poller, dispatcher,
requeue manager, NATS and Postgres: refused while jobs run there; with --force the jobs
fail as vm_removed and run elsewhere, their processes are killed, and the VM goes."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import select

from scheduler.claims.batch import claim_gpus
from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.errors import BadInput
from scheduler.fleet import remove_vm
from scheduler.gpu_poller import GpuPoller
from scheduler.models import GPU, VM, Job, Leftover
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    RLFLEET,
    add_vm_row,
    alive,
    new_job,
    running_dispatcher,
    wait_status,
    write_fake_python,
)

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, recheck_after_s=0.3, kill_grace_s=2.0)


def rlfleet(db: Database, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI, as a user runs it."""
    env = dict(os.environ, RLFLEET_DATABASE_URL=db.url)
    return subprocess.run(
        [str(RLFLEET), *args], env=env, capture_output=True, text=True, timeout=60
    )


async def vm_names(db: Database) -> list[str]:
    """The VMs the database knows."""
    async with db.transaction() as session:
        return list((await session.scalars(select(VM.name).order_by(VM.name))).all())


@pytest.mark.slow
async def test_vm_remove_refuses_then_force_fails_kills_and_reruns_elsewhere(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Given a job running on one of two VMs, `vm remove` of its VM is refused (exit 2,
    one line saying what and how) and changes nothing; `vm remove --force` fails the job
    as vm_removed, the requeue manager kills its process and deletes the VM, and the job
    runs again on the other VM without using up a retry."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    poller = GpuPoller(db, transport)
    await poller.sweep()
    nc = await nats_client.connect(nats.url)
    requeue = RequeueManager(db, NatsPublisher(nc), transport, CONFIG)
    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            job_id = await new_job(db, 1, ("--fake_seconds", "300"), max_retries=0)
            await requeue.tick()
            first = await wait_status(db, job_id, "running")
            name = next(n for n, i in ids.items() if i == first.vm_id)
            pid = first.remote_pid
            assert pid is not None and alive(pid)

            refused = rlfleet(db, "vm", "remove", name)
            assert refused.returncode == 2, refused.stderr
            lines = refused.stderr.strip().splitlines()
            assert len(lines) == 1 and "1 live job(s)" in lines[0] and "--force" in lines[0]
            assert name in await vm_names(db)
            assert (await wait_status(db, job_id, "running")).attempt == first.attempt

            forced = rlfleet(db, "vm", "remove", name, "--force")
            assert forced.returncode == 0 and forced.stderr == "", forced.stderr
            assert f"removing VM {name}" in forced.stdout and str(job_id) in forced.stdout
            failed = await wait_status(db, job_id, "failed", timeout=1)
            assert failed.failure_reason == "vm_removed" and failed.exit_code is None
            async with db.transaction() as session:
                vm = await session.scalar(select(VM).where(VM.name == name))
                assert vm is not None and vm.removing and vm.draining
                held = await session.scalar(select(GPU.id).where(GPU.job_id == job_id))
            assert held is None, "the removed VM's GPUs are freed at once"
            assert rlfleet(db, "vm", "undrain", name).returncode == 2

            # The requeue manager kills the process, deletes the VM, retries the job.
            for _ in range(100):
                await requeue.tick()
                await poller.sweep()
                if name not in await vm_names(db) and not alive(pid):
                    break
                await asyncio.sleep(0.1)
            assert not alive(pid), "the removed VM's process was killed"
            assert name not in await vm_names(db)
            second = await wait_status(db, job_id, "running", timeout=30)
            assert second.vm_id is not None and second.vm_id != first.vm_id
            assert second.attempt == first.attempt + 1
            assert (second.retry_count, second.max_retries) == (0, 0)
    finally:
        await nc.close()
    async with db.transaction() as session:
        job = await session.get(Job, job_id)
        assert job is not None
        stale = (await session.scalars(select(Leftover))).all()
    assert stale == [], "the leftover row went with the VM, after its kill"


async def test_unkilled_leftovers_refuse_a_plain_remove_and_force_twice_deletes(
    db: Database,
) -> None:
    """A VM with no live job but a process of an earlier attempt still to be killed is not
    removed without --force; --force marks it removing, and --force again deletes it."""
    vm_id = await add_vm_row(db, "leftover-vm", 1, status="unreachable")
    job_id = await new_job(db, 1)
    async with db.transaction() as session:
        session.add(Leftover(vm_id=vm_id, job_id=job_id, attempt=1, reason="node_lost"))
    with pytest.raises(BadInput, match="1 process\\(es\\) of earlier attempts not yet killed"):
        async with db.transaction() as session:
            await remove_vm(session, "leftover-vm")
    async with db.transaction() as session:
        assert (await remove_vm(session, "leftover-vm", force=True)).outcome == "removing"
    assert "leftover-vm" in await vm_names(db)
    async with db.transaction() as session:
        done = await remove_vm(session, "leftover-vm", force=True)
    assert (done.outcome, done.leftovers) == ("removed", 1)
    assert "leftover-vm" not in await vm_names(db)


async def test_a_vm_running_rank_1_of_a_job_is_refused_then_its_job_fails(db: Database) -> None:
    """Given a two-node job claimed on VMs a (rank 0) and b (rank 1), removing b is refused
    while the job is live, as removing a is: every rank's VM runs the job. With --force the
    job fails `vm_removed` and both ranks are leftovers to kill."""
    await add_vm_row(db, "a", 1)
    await add_vm_row(db, "b", 1)
    claim = await claim_gpus(db, await new_job(db, 1, nodes=2), actor="test")
    assert isinstance(claim, Claim) and len(claim.nodes) == 2
    async with db.transaction() as session:
        names = dict((await session.execute(select(VM.id, VM.name))).all())
    rank1 = names[claim.nodes[1].vm_id]
    with pytest.raises(BadInput, match="1 live job"):
        async with db.transaction() as session:
            await remove_vm(session, rank1)
    async with db.transaction() as session:
        removal = await remove_vm(session, rank1, force=True)
    assert (removal.outcome, removal.failed_jobs) == ("removing", [claim.job_id])
    async with db.transaction() as session:
        job = await session.get(Job, claim.job_id)
        assert job is not None and (job.status, job.failure_reason) == ("failed", "vm_removed")
        ranks = (await session.execute(select(Leftover.rank).order_by(Leftover.rank))).scalars()
        assert list(ranks) == [0, 1]
