"""The GPU a job computes on is the GPU it was given (docs/invariants.md, invariant 8),
with the real poller, dispatcher, NATS, Postgres and SSH fleet; only the GPUs are
simulated, on a VM of mixed models where CUDA's default numbering (fastest first) differs
from nvidia-smi's, and where nvidia-smi renumbers the GPUs between polls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import select

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.models import GPU, Job
from scheduler.transport import make_transport
from tests.fleet import SimFleet, SimVM
from tests.workloads.support import (
    FAKE_TRAIN,
    job_attempt_dir,
    new_job,
    publish,
    running_dispatcher,
    wait_file,
    wait_status,
    write_fake_python,
)

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
# nvidia-smi's index order (PCI bus order); `speed` makes CUDA's default order H100,
# A100, L4, T4, which matches none of these indices.
MODELS = [
    ("Tesla T4", 15360, 1),
    ("NVIDIA H100 80GB HBM3", 81559, 4),
    ("NVIDIA L4", 23034, 2),
    ("NVIDIA A100-SXM4-40GB", 40960, 3),
]


def job_processes(vm: SimVM) -> dict[int, list[int]]:
    """Live training processes of the VM by job id (from their RLFLEET_JOB_ID)."""
    found: dict[int, list[int]] = {}
    for pid in vm.processes():
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(v.decode(errors="replace").split("=", 1) for v in raw if b"=" in v)
        # The training process itself: the wrapper's shell was started before its exports.
        if "RLFLEET_JOB_ID" in env and "CUDA_VISIBLE_DEVICES" in env:
            found.setdefault(int(env["RLFLEET_JOB_ID"]), []).append(pid)
    return found


async def check_every_job_on_its_gpus(db: Database, vm: SimVM, job_ids: list[int]) -> None:
    """Each job's processes use exactly the GPUs (UUIDs) it was given, its
    CUDA_VISIBLE_DEVICES names them, the GPU rows say so, and no GPU is used twice."""
    async with db.transaction() as session:
        jobs = {j.id: j for j in (await session.scalars(select(Job))).all() if j.id in job_ids}
        rows = (await session.scalars(select(GPU).where(GPU.vm_id == jobs[job_ids[0]].vm_id))).all()
    allocated: dict[int, set[str]] = {}
    for row in rows:
        if row.job_id is not None:
            allocated.setdefault(row.job_id, set()).add(row.uuid)
    deadline = time.monotonic() + 20
    while set(job_processes(vm)) != set(job_ids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    processes = job_processes(vm)
    used: dict[str, int] = {}
    for job_id in job_ids:
        job = jobs[job_id]
        assert job.status == "running" and job.gpu_uuids, (job.id, job.status, job.gpu_uuids)
        given = list(job.gpu_uuids)
        assert allocated[job_id] == set(given), "the GPU rows hold what the job was given"
        log = await wait_file(
            await job_attempt_dir(db, job_id, vm.home) / "train.log", needle="fake_train: CUDA"
        )
        assert f"fake_train: CUDA_VISIBLE_DEVICES={','.join(given)}\n" in log
        assert job_id in processes, f"job {job_id} has no training process"
        for pid in processes[job_id]:
            devices = vm.devices_of(pid)
            assert devices == given, f"job {job_id} computes on {devices}, was given {given}"
            for uuid in devices:
                assert used.setdefault(uuid, job_id) == job_id, f"{uuid} used by two jobs"


async def test_jobs_compute_on_the_gpus_they_were_given_on_mixed_renumbered_gpus(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given a VM whose four GPUs are of different models (CUDA's fastest-first order is
    not nvidia-smi's) and whose nvidia-smi renumbers them between polls, when jobs are
    launched between renumberings, then each one's CUDA_VISIBLE_DEVICES names the UUIDs it
    was given and its process computes on exactly those, no GPU is used by two jobs, GPU
    rows follow their UUID (index updated, allocation kept), and a card that disappears
    is marked unhealthy (lost), its job stopped (`gpu_failed`), and nothing of its
    allocation handed to the card taking its index."""
    fleet = await sim_fleet(0)
    vm = await fleet.add_vm("mixed", models=MODELS)
    assert vm.cuda_uuids != vm.gpu_uuids
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    vm_id = ids["mixed"]
    transport = make_transport(connect_timeout=5.0, login_timeout=5.0)
    poller = GpuPoller(db, transport)
    nc = await nats_client.connect(nats.url)
    try:
        await poller.sweep()
        async with running_dispatcher(db, nats.url, transport=transport):
            first = await new_job(db, 1, ("--fake_seconds", "300"))
            await publish(nc, first)
            await wait_status(db, first, "running")
            await check_every_job_on_its_gpus(db, vm, [first])

            # A reboot renumbers the GPUs: the rows follow their UUIDs.
            vm.reorder_gpus(reversed(vm.gpu_uuids))
            await poller.sweep()
            async with db.transaction() as session:
                rows = (await session.scalars(select(GPU).where(GPU.vm_id == vm_id))).all()
            assert {r.uuid: r.index for r in rows} == {u: i for i, u in enumerate(vm.gpu_uuids)}
            assert all(r.healthy and not r.foreign_busy for r in rows)

            second = await new_job(db, 2, ("--fake_seconds", "300"))
            await publish(nc, second)
            await wait_status(db, second, "running")
            await check_every_job_on_its_gpus(db, vm, [first, second])

            order = vm.gpu_uuids
            vm.reorder_gpus(order[1:] + order[:1])
            await poller.sweep()
            third = await new_job(db, 1, ("--fake_seconds", "300"))
            await publish(nc, third)
            await wait_status(db, third, "running")
            await check_every_job_on_its_gpus(db, vm, [first, second, third])
            await poller.sweep()
            async with db.transaction() as session:
                rows = (await session.scalars(select(GPU).where(GPU.vm_id == vm_id))).all()
                third_row = await session.get(Job, third)
            assert all(r.job_id is not None and not r.foreign_busy for r in rows)

            # The third job's card disappears: its row stays, unhealthy (lost), the job on it
            # is stopped; the card that takes over its index is not given its allocation.
            assert third_row is not None and third_row.gpu_uuids is not None
            gone = third_row.gpu_uuids[0]
            vm.reorder_gpus([u for u in vm.gpu_uuids if u != gone])
            await poller.sweep()
            async with db.transaction() as session:
                rows = (await session.scalars(select(GPU).where(GPU.vm_id == vm_id))).all()
                third_row = await session.get(Job, third)
            by_uuid = {r.uuid: r for r in rows}
            assert not by_uuid[gone].healthy
            assert (by_uuid[gone].health_reason or "").startswith("lost")
            assert third_row is not None
            assert (third_row.status, third_row.failure_reason) == ("failed", "gpu_failed")
            assert not [r.uuid for r in rows if r.job_id == third]
            assert all(r.healthy for u, r in by_uuid.items() if u != gone)
    finally:
        await nc.close()
        await transport.close()
