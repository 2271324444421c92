"""Three dispatchers, one fleet, every message twice: no GPU is ever shared, no job
launched twice (docs/invariants.md, invariant 1 and 2, with the dispatcher's part of invariant 3).
The real
poller and requeue manager run beside them: finished jobs free their GPUs and pending jobs
are woken the way they are in production."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import func, select

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller, run_poller
from scheduler.models import GPU, Job, JobEvent
from scheduler.remote.layout import job_base
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.transport import make_transport
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    installation,
    new_job,
    publish,
    read_records,
    running_dispatcher,
    write_fake_python,
)

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

VMS, GPUS_PER_VM, JOBS, DISPATCHERS = 20, 4, 300, 3


def overlaps(intervals: list[tuple[float, float, object]]) -> list[tuple[object, object]]:
    """Pairs of intervals (start, end, who) that overlap in time."""
    clashes = []
    ordered = sorted(intervals, key=lambda i: i[0])
    for (_s1, e1, a), (s2, _e2, b) in zip(ordered, ordered[1:], strict=False):
        if s2 < e1:
            clashes.append((a, b))
    return clashes


async def test_three_dispatchers_never_share_a_gpu_or_launch_twice(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given 20 VMs with 4 GPUs each and three dispatchers, when 300 jobs of 1-4 GPUs
    are each published twice (and pending ones again whenever GPUs free up), then every
    job runs exactly once, and no GPU is held by two live jobs: neither in the database's
    history nor in what the workloads themselves saw in CUDA_VISIBLE_DEVICES."""
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("RLFLEET_FAKE_RECORD", str(records))  # inherited by the VMs' shells
    fleet = await sim_fleet(VMS, gpus_per_vm=GPUS_PER_VM)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    transport = make_transport()
    await GpuPoller(db, transport).sweep()  # GPU rows exist before the first claim
    homes = {ids[vm.name]: vm.home for vm in fleet}
    rng = random.Random(300)
    sizes: dict[int, int] = {}
    for _ in range(JOBS):
        gpus = rng.randint(1, 4)
        seconds = f"{rng.uniform(0.2, 0.6):.2f}"
        sizes[await new_job(db, gpus, ("--fake_seconds", seconds))] = gpus
    nc = await nats_client.connect(nats.url)
    stop = asyncio.Event()
    requeue = RequeueManager(
        db,
        NatsPublisher(nc),
        transport,
        RequeueConfig(interval_s=0.2, recheck_after_s=0.3, republish_after_s=30),
    )

    started = time.monotonic()
    async with AsyncExitStack() as stack:
        dispatchers = [
            await stack.enter_async_context(running_dispatcher(db, nats.url))
            for _ in range(DISPATCHERS)
        ]
        helpers = [
            asyncio.create_task(run_poller(db, transport, stop, interval=0.2)),
            asyncio.create_task(requeue.run(stop)),
        ]
        try:
            ids_twice = list(sizes) * 2
            rng.shuffle(ids_twice)
            await publish(nc, *ids_twice)
            while time.monotonic() - started < 180:
                async with db.transaction() as session:
                    left = await session.scalar(
                        select(func.count()).where(Job.status.not_in(["completed", "failed"]))
                    )
                if left == 0:
                    break
                await asyncio.sleep(0.2)
        finally:
            stop.set()
            await asyncio.gather(*helpers)
    await nc.close()
    await transport.close()
    elapsed = time.monotonic() - started

    async with db.transaction() as session:
        jobs = (await session.execute(select(Job))).scalars().all()
        held = await session.scalar(select(func.count()).where(GPU.job_id.is_not(None)))
        moves = (
            await session.execute(
                select(JobEvent.job_id, JobEvent.to_status).where(
                    JobEvent.from_status == "starting"
                )
            )
        ).all()
    assert Counter(j.status for j in jobs) == {"completed": JOBS}, elapsed
    assert held == 0
    # Exactly once: one launch per job, one attempt directory, one run of the workload.
    assert {j.attempt for j in jobs} == {1}
    # A short job can end before its dispatcher records it running: the poller then moves
    # it `starting → completed` itself, and that dispatcher's late record loses.
    out_of_starting = Counter(
        (job_id, to) for job_id, to in moves if to in ("running", "completed")
    )
    assert sorted(job_id for job_id, _to in out_of_starting) == sorted(sizes)
    assert set(out_of_starting.values()) == {1}
    recorded_running = sum(1 for _job, to in out_of_starting if to == "running")
    assert sum(d.stats.launched for d in dispatchers) == recorded_running
    inst = await installation(db)
    for job in jobs:
        dirs = list((homes[job.vm_id] / job_base(inst, job.id)).iterdir())
        assert [p.name for p in dirs] == [f"1-{job.launch_token}"]
        assert len(job.gpu_indices) == sizes[job.id]
    runs = read_records(records)
    starts = Counter(r["job_id"] for r in runs if r["event"] == "start")
    assert starts == Counter({str(j): 1 for j in sizes})
    # Multi-GPU jobs went through the accelerate launcher with the right process count.
    assert all(
        r.get("num_processes")
        == (str(sizes[int(r["job_id"])]) if sizes[int(r["job_id"])] > 1 else None)
        for r in runs
        if r["event"] == "start"
    )

    # No GPU shared, as the database recorded it: claim → finish intervals per GPU.
    by_gpu_db: dict[tuple[int, int], list[tuple[float, float, object]]] = defaultdict(list)
    for job in jobs:
        for index in job.gpu_indices:
            by_gpu_db[(job.vm_id, index)].append(
                (job.starting_at.timestamp(), job.finished_at.timestamp(), job.id)
            )
    assert not [c for iv in by_gpu_db.values() for c in overlaps(iv)]
    # … and as the workloads saw it: what each process had in CUDA_VISIBLE_DEVICES.
    spans: dict[str, dict[str, float]] = defaultdict(dict)
    where: dict[str, tuple[str, list[str]]] = {}
    for r in runs:
        spans[r["job_id"]][r["event"]] = r["t"]
        where[r["job_id"]] = (r["vm"], r["gpus"].split(","))
    by_gpu_seen: dict[tuple[str, str], list[tuple[float, float, object]]] = defaultdict(list)
    for job_id, (vm, gpus) in where.items():
        for gpu in gpus:
            by_gpu_seen[(vm, gpu)].append((spans[job_id]["start"], spans[job_id]["end"], job_id))
    assert not [c for iv in by_gpu_seen.values() for c in overlaps(iv)]
    assert sum(len(v) for v in by_gpu_seen.values()) == sum(sizes.values())
