"""Helpers for the dispatcher tests and benchmark: VM/GPU rows, a dispatcher in a task,
a stand-in VM interpreter, and a small loop that plays the poller's part."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats as nats_client
from nats.aio.client import Client as NATS
from sqlalchemy import select, text, update

from scheduler import bus
from scheduler.db import Database, installation_id
from scheduler.dispatcher import GlobalJobDispatcher
from scheduler.gpu_poller import GpuPoller, run_poller
from scheduler.jobs import JobSpec, insert_job, transition
from scheduler.models import GPU, VM, Job, JobNode
from scheduler.remote.launch import LaunchSpec, launch_script, parse_launch
from scheduler.remote.layout import Attempt, default_output_dir, job_base, new_token, stored_attempt
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.states import JobStatus
from scheduler.transport import Transport, VMTarget, make_transport
from tests.fleet import FAKE_TRAIN, SimFleet

RLFLEET = Path(sys.executable).parent / "rlfleet"
"""The installed `rlfleet` command, for tests that run the real CLI."""


def write_fake_python(folder: Path) -> str:
    """A stand-in VM interpreter that runs `-m accelerate.commands.launch --num_processes N
    SCRIPT …` as one cheap `python SCRIPT …` (exporting N), so that tests with many
    multi-GPU jobs do not pay for importing torch; a rank of a multi-node job
    (`--multi_gpu --num_machines K … --num_processes N [--mixed_precision no --dynamo_backend
    no] SCRIPT`) likewise. Anything else runs
    unchanged."""
    path = folder / "fake-python"
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "accelerate.commands.launch" ] '
        '&& [ "$3" = "--num_processes" ]; then\n'
        '  RLFLEET_FAKE_NUM_PROCESSES="$4"; export RLFLEET_FAKE_NUM_PROCESSES; shift 4\n'
        'elif [ "$1" = "-m" ] && [ "$2" = "accelerate.commands.launch" ] '
        '&& [ "$3" = "--multi_gpu" ] && [ "${12}" = "--num_processes" ]; then\n'
        '  RLFLEET_FAKE_NUM_PROCESSES="${13}"; export RLFLEET_FAKE_NUM_PROCESSES; shift 13\n'
        '  if [ "$1" = "--mixed_precision" ] && [ "$3" = "--dynamo_backend" ]; then shift 4; fi\n'
        "fi\n"
        f'exec {sys.executable} -S "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


async def mark_polled(
    db: Database, gpus_by_vm: dict[int, int], uuids: dict[int, list[str]] | None = None
) -> None:
    """Do what a first poll does: VMs healthy, one idle GPU row per simulated GPU, with the
    UUIDs its nvidia-smi reports when `uuids` gives them (by VM id, in index order)."""
    async with db.transaction() as session:
        for vm_id, count in gpus_by_vm.items():
            await session.execute(
                update(VM).where(VM.id == vm_id).values(status="healthy", available_gpus=count)
            )
            named = (uuids or {}).get(vm_id) or [f"GPU-{vm_id}-{i}" for i in range(count)]
            session.add_all(
                GPU(vm_id=vm_id, index=i, uuid=named[i], healthy=True) for i in range(count)
            )


async def new_job(db: Database, gpus: int = 1, extra: tuple[str, ...] = (), **spec: Any) -> int:
    """Insert a queued job (not published)."""
    async with db.transaction() as session:
        job = await insert_job(
            session,
            JobSpec(
                model=spec.pop("model", "tiny"),
                dataset=spec.pop("dataset", "data.jsonl"),
                reward_functions=spec.pop("reward_functions", ("format",)),
                gpus=gpus,
                extra_args=extra,
                **spec,
            ),
            actor="test",
        )
        return job.id


async def publish(nc: NATS, *job_ids: int | bytes) -> None:
    """Plain `nc.publish("jobs.new", …)`, as a user's script would."""
    for job_id in job_ids:
        payload = job_id if isinstance(job_id, bytes) else str(job_id).encode()
        await nc.publish(bus.SUBJECT_NEW, payload)
    await nc.flush()


async def job_row(db: Database, job_id: int) -> Job:
    """The job as the database has it now."""
    async with db.transaction() as session:
        job = await session.scalar(select(Job).where(Job.id == job_id))
        assert job is not None
        return job


async def wait_status(
    db: Database, job_id: int, statuses: set[str] | str, timeout: float = 20
) -> Job:
    """Wait until the job is in one of `statuses`."""
    wanted = {statuses} if isinstance(statuses, str) else statuses
    deadline = time.monotonic() + timeout
    while True:
        job = await job_row(db, job_id)
        if job.status in wanted:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} is {job.status} ({job.status_reason}), not {wanted}"
            )
        await asyncio.sleep(0.05)


async def wait_file(path: Path, timeout: float = 15, needle: str | None = None) -> str:
    """The text of `path` once it exists and is not empty (and holds `needle`, if given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.strip() and (needle is None or needle in text):
            return text
        await asyncio.sleep(0.05)
    if needle is not None:
        raise AssertionError(f"{path} never said {needle!r}")
    raise AssertionError(f"{path} never appeared")


@asynccontextmanager
async def scheduling(
    db: Database, nats_url: str, transport: Transport, config: RequeueConfig
) -> AsyncIterator[RequeueManager]:
    """A dispatcher running and a requeue manager on a NATS connection of its own, as the
    daemons would be; the test steps the poller and the requeue manager itself."""
    nc = await nats_client.connect(nats_url)
    try:
        async with running_dispatcher(db, nats_url, transport=transport):
            yield RequeueManager(db, NatsPublisher(nc), transport, config)
    finally:
        await nc.close()


async def job_nodes(db: Database, job_id: int) -> list[JobNode]:
    """The job's rank rows (`job_nodes`: one per node of a multi-node job or a group over
    several VMs), rank 0 first."""
    async with db.transaction() as session:
        rows = await session.execute(
            select(JobNode).where(JobNode.job_id == job_id).order_by(JobNode.rank)
        )
        return list(rows.scalars())


async def run_to_the_end(
    db: Database,
    nats_url: str,
    transport: Transport,
    poller: GpuPoller,
    job_id: int,
    config: RequeueConfig,
    *,
    timeout_s: float = 600,
    tick_s: float = 0.5,
) -> Job:
    """Schedule until the job is `completed` or `failed` (`scheduling`; the requeue manager
    announces it, the poller is stepped here), within `timeout_s`; its row then."""
    deadline = time.monotonic() + timeout_s
    async with scheduling(db, nats_url, transport, config) as requeue:
        while (job := await job_row(db, job_id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"job {job_id} is still {job.status}"
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(tick_s)
    return job


@asynccontextmanager
async def running_dispatcher(
    db: Database, nats_url: str, *, transport: Transport | None = None, **options: Any
) -> AsyncIterator[GlobalJobDispatcher]:
    """A dispatcher with its own NATS connection, running in a task until the block ends."""
    nc = await nats_client.connect(nats_url)
    own = transport is None
    transport = transport or make_transport()
    # A database handle of its own, as a dispatcher process would have.
    own_db = Database(db.url, pool_size=10)
    dispatcher = GlobalJobDispatcher(
        own_db, nc.jetstream(), transport, fetch_timeout_s=0.2, **options
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(dispatcher.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield dispatcher
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()
        await own_db.dispose()
        if own:
            await transport.close()


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every line fake_train wrote to its run record."""
    lines = []
    for path in sorted(folder.glob("*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def alive(pid: int) -> bool:
    """Whether a process (not a zombie) has this pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def add_vm_row(db: Database, name: str, gpus: int, **fields: Any) -> int:
    """A VM row with no SSH server behind it (for claim and requeue logic), healthy unless
    `fields` say otherwise, with `gpus` idle GPUs."""
    fields.setdefault("status", "healthy")
    async with db.transaction() as session:
        vm = VM(name=name, host="127.0.0.1", available_gpus=gpus, **fields)
        session.add(vm)
        await session.flush()
        session.add_all(GPU(vm_id=vm.id, index=i, uuid=f"GPU-{name}-{i}") for i in range(gpus))
        return vm.id


async def polled_fleet(
    sim_fleet: Any, db: Database, n_vms: int, gpus: int
) -> tuple[SimFleet, dict[str, int]]:
    """A started test fleet running fake_train, registered and marked as polled."""
    fleet = await sim_fleet(n_vms, gpus_per_vm=gpus)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN))
    uuids = {vm_id: fleet.by_name(name).gpu_uuids for name, vm_id in ids.items()}
    await mark_polled(db, {vm_id: gpus for vm_id in ids.values()}, uuids)
    return fleet, ids


async def installation(db: Database) -> str:
    """The database's installation id."""
    async with db.transaction() as session:
        return await installation_id(session)


RANK0_FROM_JOB_SQL = text(
    """
INSERT INTO job_nodes (job_id, rank, attempt, vm_id, gpu_indices, gpu_uuids, remote_pid,
                       attempt_dir)
SELECT id, 0, attempt, vm_id, coalesce(gpu_indices, '{}'), coalesce(gpu_uuids, '{}'),
       remote_pid, attempt_dir
FROM jobs WHERE id = :job_id
ON CONFLICT (job_id, rank) DO UPDATE SET
    attempt = excluded.attempt, vm_id = excluded.vm_id, gpu_indices = excluded.gpu_indices,
    gpu_uuids = excluded.gpu_uuids, remote_pid = excluded.remote_pid,
    attempt_dir = excluded.attempt_dir, exit_code = NULL
"""
)


async def place_rank0(session: Any, job_id: int) -> None:
    """Write the job's rank 0 `job_nodes` row from its job row, as the claim and the
    launch record do, for a test that moves a job to starting or running by hand (every
    claimed attempt has its rows in `job_nodes`)."""
    await session.execute(RANK0_FROM_JOB_SQL, {"job_id": job_id})


async def current_attempt(db: Database, job_id: int) -> Attempt:
    """The attempt the job row names now (with its recorded directory once launched)."""
    job = await job_row(db, job_id)
    run = stored_attempt(
        await installation(db),
        job.id,
        job.completed_attempt or job.attempt,
        job.launch_token,
        job.attempt_dir,
    )
    assert run is not None, f"job {job_id} has no attempt yet"
    return run


def attempt_dir(home: Path, run: Attempt) -> Path:
    """Where the attempt's files are on a simulated VM whose $HOME is `home`."""
    return Path(run.path) if run.path is not None else home / run.relative


async def job_attempt_dir(db: Database, job_id: int, home: Path) -> Path:
    """The directory of the job's current attempt on the VM whose $HOME is `home`."""
    return attempt_dir(home, await current_attempt(db, job_id))


def attempt_dirs(home: Path, installation: str, job_id: int, attempt: int) -> list[Path]:
    """Every directory of attempt `attempt` of the job under `home` (one per claim of it)."""
    return sorted((home / job_base(installation, job_id)).glob(f"{int(attempt)}-*"))


async def sweep_until(poller: GpuPoller, db: Database, vm_id: int, status: str) -> None:
    """Let the poller sweep until it has marked the VM `status`."""
    for _ in range(100):
        await poller.sweep()
        async with db.transaction() as session:
            if await session.scalar(select(VM.status).where(VM.id == vm_id)) == status:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"VM {vm_id} never became {status}")


@asynccontextmanager
async def daemons(db: Database, nats_url: str, config: RequeueConfig) -> AsyncIterator[Transport]:
    """The poller (every 0.2 s), a dispatcher and the requeue manager with `config`, all
    on one transport, running until the block ends; yields the transport."""
    transport = make_transport(connect_timeout=5.0, login_timeout=5.0)
    nc = await nats_client.connect(nats_url)
    stop = asyncio.Event()
    requeue = RequeueManager(db, NatsPublisher(nc), transport, config)
    tasks = [
        asyncio.create_task(run_poller(db, transport, stop, interval=0.2)),
        asyncio.create_task(requeue.run(stop)),
    ]
    try:
        async with running_dispatcher(db, nats_url, transport=transport):
            yield transport
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await nc.close()
        await transport.close()


async def launch_on(
    db: Database, transport: Transport, target: VMTarget, gpu: int, *args: str
) -> int:
    """A running job on `target` holding GPU `gpu`, launched the way the dispatcher does."""
    async with db.transaction() as session:
        job = await insert_job(session, JobSpec("m", "d", ("format",)), actor="test")
        await transition(
            session,
            job.id,
            expected=JobStatus.QUEUED,
            to=JobStatus.STARTING,
            reason="claimed",
            actor="test",
            values={
                "vm_id": target.id,
                "attempt": 1,
                "gpu_indices": [gpu],
                "launch_token": new_token(),
            },
        )
        await session.execute(
            update(GPU).where(GPU.vm_id == target.id, GPU.index == gpu).values(job_id=job.id)
        )
        job_id = job.id
    run = await current_attempt(db, job_id)
    spec = LaunchSpec(
        run=run,
        python=sys.executable,
        entrypoint=str(FAKE_TRAIN),
        gpu_indices=[gpu],
        model="m",
        dataset="d",
        reward_functions=["format"],
        output_dir=default_output_dir(run.installation, job_id),
        extra_args=list(args),
    )
    result = await transport.run(target, launch_script(spec), timeout=20)
    launched = parse_launch(result.stdout, run)
    assert launched is not None and launched.path is not None, result.stderr
    async with db.transaction() as session:
        await transition(
            session,
            job_id,
            expected=JobStatus.STARTING,
            to=JobStatus.RUNNING,
            reason="launched",
            actor="test",
            values={"remote_pid": launched.pid, "attempt_dir": launched.path},
        )
        await place_rank0(session, job_id)  # every placed attempt has its rank rows
    return job_id
