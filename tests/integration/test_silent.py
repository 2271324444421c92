"""A VM that goes silent (TCP connects, nothing answers) is given up in bounded time, and
its attempt fences itself off before its job runs anywhere else.

Two kinds of silence: a test VM behind a relay that turns into a black hole
(`SimVM.silence`), and OpenSSH's real sshd frozen with SIGSTOP (a hung or paused VM). The
daemons run with their DEFAULT settings (scheduler/liveness.py), as an operator runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import select, update

from scheduler.db import Database
from scheduler.dispatcher import run_dispatcher
from scheduler.embedded import EmbeddedNats
from scheduler.fleet import VMSpec, add_vm
from scheduler.gpu_poller import run_poller
from scheduler.jobs import JobSpec
from scheduler.liveness import Liveness, SSHDeadlines
from scheduler.models import VM, Job, JobEvent
from scheduler.remote.watchdog import FENCED_FILE
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.settings import Settings
from scheduler.submit import submit_job
from scheduler.transport import SSHTransport, Transport, TransportError, make_transport
from tests.fleet import FAKE_TRAIN, SimFleet, SimVM
from tests.integration.test_sshd import RealSshd, sshd  # noqa: F401 (the fixture)
from tests.workloads.support import attempt_dirs, installation, write_fake_python

FleetFactory = Callable[..., Awaitable[SimFleet]]
DEFAULTS = Liveness()
UNREACHABLE_BOUND_S = 15.0
NODE_LOST_BOUND_S = 30.0
BLIP_S = 10.0


# --- the transport ----------------------------------------------------------------------


async def _bounded(coro: Awaitable[object], limit: float) -> float:
    """Seconds until `coro` raised TransportError; fails if it succeeds or takes `limit`."""
    started = time.monotonic()
    with pytest.raises(TransportError):
        await asyncio.wait_for(coro, limit)
    return time.monotonic() - started


@pytest.mark.slow
async def test_every_ssh_step_to_a_silent_vm_has_a_deadline(sim_fleet: FleetFactory) -> None:
    """Given pooled connections to a VM, when it goes silent, then a command on the pooled
    shell, a command on a fresh channel and a fresh connect each fail within their own
    deadline (never hang), and once it answers again the next command works."""
    fleet = await sim_fleet(1, silenceable=True)
    vm = fleet[0]
    transport = SSHTransport(connect_timeout=2.0)
    try:
        assert (await transport.run(vm.target(), "echo up", timeout=5, persistent=True)).ok
        assert (await transport.run(vm.target(), "echo up", timeout=5)).ok
        vm.silence()
        # The pooled shell, twice (the second finds the connection abandoned: it reconnects
        # and the connect has its deadline), then an exec channel, then a new transport.
        first = await _bounded(transport.run(vm.target(), "true", timeout=1.5, persistent=True), 20)
        second = await _bounded(
            transport.run(vm.target(), "true", timeout=1.5, persistent=True), 20
        )
        third = await _bounded(transport.run(vm.target(), "true", timeout=1.5), 20)
        fresh = SSHTransport(connect_timeout=2.0)
        try:
            connect = await _bounded(fresh.run(vm.target(), "true", timeout=1.5), 20)
        finally:
            await fresh.close()
        print(
            f"silent VM: pooled shell {first:.1f}s, next command {second:.1f}s, exec "
            f"{third:.1f}s, new connection {connect:.1f}s"
        )
        assert first < 1.5 + 1.0 and third < 2.0 + 1.5 + 1.0
        assert second < 2.0 + 1.5 + 1.0 and connect < 2.0 + 1.0 + 1.0
        vm.unsilence()
        result = await asyncio.wait_for(
            transport.run(vm.target(), "echo back", timeout=5, persistent=True), 20
        )
        assert result.stdout.strip() == "back"
    finally:
        vm.unsilence()
        await asyncio.wait_for(transport.close(), 10)


@pytest.mark.slow
async def test_keepalives_drop_an_idle_connection_to_a_silent_vm(sim_fleet: FleetFactory) -> None:
    """Given an idle pooled connection, when its VM goes silent, then the default
    keepalives find it dead and drop it within interval * (count + 1) seconds."""
    fleet = await sim_fleet(1, silenceable=True)
    vm = fleet[0]
    transport = SSHTransport()
    bound = SSHDeadlines().dead_after_s
    try:
        assert (await transport.run(vm.target(), "true", timeout=5)).ok
        assert transport.open_connections == 1
        vm.silence()
        started = time.monotonic()
        while transport.open_connections:
            assert time.monotonic() - started < bound + 3, "a dead connection stayed open"
            await asyncio.sleep(0.1)
        print(f"keepalives dropped the silent connection after {time.monotonic() - started:.1f}s")
    finally:
        vm.unsilence()
        await asyncio.wait_for(transport.close(), 10)


# --- the poller -------------------------------------------------------------------------


@pytest.mark.slow
async def test_one_silent_vm_never_slows_the_sweep_of_the_others(
    sim_fleet: FleetFactory, db: Database
) -> None:
    """Given three VMs polled with the default settings, when one goes silent, then the
    other two are still polled every interval, and the silent one is unreachable within
    15 s."""
    fleet = await sim_fleet(3, silenceable=True)
    ids = await fleet.register(db)
    transport = make_transport()
    stop = asyncio.Event()
    task = asyncio.create_task(run_poller(db, transport, stop))
    silent_id = ids[fleet[0].name]
    healthy = [ids[vm.name] for vm in fleet.vms[1:]]
    try:
        await _wait_vm(db, silent_id, "healthy", 30)
        fleet[0].silence()
        silenced = time.monotonic()
        polled: dict[int, list[datetime]] = {vm_id: [] for vm_id in healthy}
        unreachable_after = None
        while time.monotonic() - silenced < 25:
            async with db.transaction() as session:
                rows = (await session.execute(select(VM.id, VM.status, VM.last_seen_at))).all()
            for vm_id, status, seen in rows:
                if vm_id == silent_id and status == "unreachable" and unreachable_after is None:
                    unreachable_after = time.monotonic() - silenced
                if vm_id in polled and seen is not None and seen not in polled[vm_id][-1:]:
                    polled[vm_id].append(seen)
            await asyncio.sleep(0.2)
        gaps = [
            (b - a).total_seconds()
            for seen in polled.values()
            for a, b in zip(seen, seen[1:], strict=False)
        ]
        print(
            f"one silent VM: unreachable after {unreachable_after}s; the others answered "
            f"{min(len(s) for s in polled.values())}+ times in 25 s, longest gap "
            f"{max(gaps):.1f}s (interval {DEFAULTS.poll_interval_s:g}s)"
        )
        assert unreachable_after is not None and unreachable_after <= UNREACHABLE_BOUND_S
        assert max(gaps) < DEFAULTS.poll_interval_s + 2.0, gaps
        assert min(len(s) for s in polled.values()) >= 4
    finally:
        fleet[0].unsilence()
        stop.set()
        await asyncio.wait_for(task, 30)
        await transport.close()


async def _wait_vm(db: Database, vm_id: int, status: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        async with db.transaction() as session:
            if await session.scalar(select(VM.status).where(VM.id == vm_id)) == status:
                return
        assert time.monotonic() < deadline, f"VM {vm_id} never became {status}"
        await asyncio.sleep(0.1)


# --- the whole scheduler ----------------------------------------------------------------


@dataclasses.dataclass
class Silenceable:
    """A VM that can be made silent: how to register it, silence it and heal it."""

    spec: VMSpec
    home: Path
    silence: Callable[[], None]
    heal: Callable[[], None]


@dataclasses.dataclass
class Timeline:
    """Seconds after the VM went silent at which each thing happened (node_lost and the
    restart from the job's events, the rest as first seen by sampling every 0.1 s)."""

    unreachable: float | None = None
    attempt_stopped: float | None = None
    node_lost: float | None = None
    restarted: float | None = None
    """The next attempt claimed GPUs elsewhere (queued -> starting)."""
    elsewhere: float | None = None
    """The next attempt runs elsewhere."""


@contextlib.asynccontextmanager
async def scheduler(db: Database, nats_url: str) -> AsyncIterator[Transport]:
    """The poller, a dispatcher and the requeue manager with their default settings."""
    transport = make_transport()
    settings = Settings(database_url=db.url, nats_url=nats_url)
    nc = await nats_client.connect(nats_url)
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(run_poller(db, transport, stop)),
        asyncio.create_task(run_dispatcher(settings, stop, transport=transport)),
        asyncio.create_task(
            RequeueManager(db, NatsPublisher(nc), transport, RequeueConfig()).run(stop)
        ),
    ]
    try:
        yield transport
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await nc.close()
        await transport.close()


async def start_job_on(
    db: Database, nats_url: str, vm: Silenceable, other: SimVM, python: str
) -> tuple[int, int, int, int]:
    """Register `vm` and `other` (draining), run one long job on `vm`; then `other` takes
    work. Returns (job id, vm id, other's id, the attempt's process group)."""
    async with db.transaction() as session:
        vm_id = (await add_vm(session, vm.spec)).id
        other_id = (await add_vm(session, other.spec(python=python))).id
        await session.execute(update(VM).where(VM.id == other_id).values(draining=True))
    settings = Settings(database_url=db.url, nats_url=nats_url)
    await _wait_vm(db, vm_id, "healthy", 30)
    spec = JobSpec(
        model="tiny",
        dataset="data.jsonl",
        reward_functions=("format",),
        extra_args=("--fake_seconds", "600"),
    )
    job_id = (await submit_job(db, settings, spec, actor="test")).job_id
    deadline = time.monotonic() + 30
    while True:
        async with db.transaction() as session:
            job = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
        if job.status == "running" and job.remote_pid is not None:
            break
        assert time.monotonic() < deadline, f"job never ran: {job.status} {job.status_reason}"
        await asyncio.sleep(0.1)
    assert job.vm_id == vm_id
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.id == other_id).values(draining=False))
    return job_id, vm_id, other_id, job.remote_pid


@contextlib.contextmanager
def killed_at_end(pgid: int) -> Iterator[None]:
    """Kill the attempt's process group when the block ends (a VM behind the real sshd is
    this machine: nothing else would)."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any process of the attempt (its process group) still runs; a zombie (dead,
    waiting for a slow reaper) does not."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it ended while we looked
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


async def watch(db: Database, job_id: int, vm_id: int, pgid: int, until: float) -> Timeline:
    """Sample every 0.1 s from now (the VM just went silent) until the job runs on another
    VM or `until` seconds passed."""
    started, wall = time.monotonic(), time.time()
    seen = Timeline()
    while (elapsed := time.monotonic() - started) < until:
        async with db.transaction() as session:
            vm_status = await session.scalar(select(VM.status).where(VM.id == vm_id))
            job = (
                await session.execute(select(Job.status, Job.vm_id).where(Job.id == job_id))
            ).one()
        if seen.unreachable is None and vm_status == "unreachable":
            seen.unreachable = elapsed
        if seen.attempt_stopped is None and not group_alive(pgid):
            seen.attempt_stopped = elapsed
        if job.status == "running" and job.vm_id != vm_id:
            break
        await asyncio.sleep(0.1)
    for _from, to, reason, attempt, at in await events(db, job_id):
        if to == "failed" and reason.startswith("node_lost") and seen.node_lost is None:
            seen.node_lost = at.timestamp() - wall
        if to == "starting" and attempt == 2:
            seen.restarted = at.timestamp() - wall
        if to == "running" and attempt == 2:
            seen.elsewhere = at.timestamp() - wall
    return seen


async def events(db: Database, job_id: int) -> list[tuple[str | None, str, str, int, datetime]]:
    """The job's history: (from, to, reason, attempt, time)."""
    async with db.transaction() as session:
        rows = (
            await session.execute(
                select(
                    JobEvent.from_status,
                    JobEvent.to_status,
                    JobEvent.reason,
                    JobEvent.attempt,
                    JobEvent.created_at,
                )
                .where(JobEvent.job_id == job_id)
                .order_by(JobEvent.id)
            )
        ).all()
    return [(r[0], r[1], r[2] or "", r[3], r[4]) for r in rows]


async def partition(
    db: Database, nats_url: str, vm: Silenceable, other: SimVM, python: str
) -> Timeline:
    """The VM goes silent for good while its job runs: bounded recovery, and no two
    attempts of the job ever run at once. Then it answers again: nothing of the old
    attempt runs, and the job's history says it fenced itself."""
    async with scheduler(db, nats_url):
        job_id, vm_id, _other_id, pgid = await start_job_on(db, nats_url, vm, other, python)
        with killed_at_end(pgid):
            return await _partitioned(db, vm, job_id, vm_id, pgid)


async def _partitioned(
    db: Database, vm: Silenceable, job_id: int, vm_id: int, pgid: int
) -> Timeline:
    vm.silence()
    try:
        seen = await watch(db, job_id, vm_id, pgid, until=60)
    finally:
        vm.heal()
    print(f"silent VM: {seen}")
    assert seen.unreachable is not None and seen.unreachable <= UNREACHABLE_BOUND_S, seen
    assert seen.node_lost is not None and seen.node_lost <= NODE_LOST_BOUND_S, seen
    assert seen.elsewhere is not None and seen.restarted is not None, seen
    # The watchdog stopped the old attempt before the job started elsewhere.
    assert seen.attempt_stopped is not None and seen.attempt_stopped < seen.restarted, seen
    # Healed: the old attempt stays dead, and `job show` says it had fenced itself.
    (attempt_dir,) = attempt_dirs(vm.home, await installation(db), job_id, 1)
    assert "lease not renewed" in (attempt_dir / FENCED_FILE).read_text()
    assert "rlfleet: fenced:" in (attempt_dir / "train.log").read_text()
    deadline = time.monotonic() + 40
    while not any(e[2].startswith("fenced: attempt 1") for e in await events(db, job_id)):
        assert time.monotonic() < deadline, await events(db, job_id)
        await asyncio.sleep(0.2)
    assert not group_alive(pgid)
    return seen


async def blip(db: Database, nats_url: str, vm: Silenceable, other: SimVM, python: str) -> None:
    """The VM is silent for 10 s, then answers again: nothing is restarted or fenced."""
    async with scheduler(db, nats_url):
        job_id, vm_id, _other_id, pgid = await start_job_on(db, nats_url, vm, other, python)
        with killed_at_end(pgid):
            await _blipped(db, vm, job_id, vm_id, pgid)


async def _blipped(db: Database, vm: Silenceable, job_id: int, vm_id: int, pgid: int) -> None:
    before = await events(db, job_id)
    vm.silence()
    try:
        await asyncio.sleep(BLIP_S)
    finally:
        vm.heal()
    # Watch until well past the node-lost timeout, counted from the start of the blip.
    end = time.monotonic() + DEFAULTS.node_lost_timeout_s + 8 - BLIP_S
    while time.monotonic() < end:
        assert group_alive(pgid), "the attempt stopped during a short blip"
        await asyncio.sleep(0.5)
    await _wait_vm(db, vm_id, "healthy", 20)
    async with db.transaction() as session:
        job = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
    assert (job.status, job.attempt, job.vm_id) == ("running", 1, vm_id)
    assert await events(db, job_id) == before
    dirs = attempt_dirs(vm.home, await installation(db), job_id, 1)
    assert dirs and not any((d / FENCED_FILE).exists() for d in dirs)


@pytest.mark.slow
async def test_a_black_holed_vm_is_lost_in_bounded_time_and_its_attempt_fences_itself(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given a job running on a VM, when the VM turns into a black hole (connections are
    accepted, nothing answers), then it is unreachable within 15 s, the job is node_lost
    within 30 s and runs elsewhere, the old attempt having stopped itself first."""
    fleet = await sim_fleet(2, silenceable=True)
    python = write_fake_python(tmp_path)
    vm = fleet[0]
    silent = Silenceable(vm.spec(python=python), vm.home, vm.silence, vm.unsilence)
    await partition(db, nats.url, silent, fleet[1], python)


@pytest.mark.slow
async def test_a_10s_black_hole_restarts_nothing(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given a job running on a VM, when the VM is a black hole for 10 s, then the job keeps
    running there, unfenced, and nothing is restarted."""
    fleet = await sim_fleet(2, silenceable=True)
    python = write_fake_python(tmp_path)
    vm = fleet[0]
    silent = Silenceable(vm.spec(python=python), vm.home, vm.silence, vm.unsilence)
    await blip(db, nats.url, silent, fleet[1], python)


def _frozen_sshd(server: RealSshd, python: str) -> Silenceable:
    """The real sshd as a VM whose silence is SIGSTOP of every sshd process."""
    stopped: list[int] = []

    def freeze() -> None:
        for pid in server.sshd_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)

    def thaw() -> None:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        stopped.clear()

    t = server.target
    spec = VMSpec(
        name=t.name,
        host=t.host,
        port=t.port,
        user=t.user,
        ssh_key_path=t.ssh_key_path,
        known_hosts=t.known_hosts,
        verify_host_key=True,
        transport="ssh",
        python=python,
        entrypoint=str(FAKE_TRAIN),
    )
    return Silenceable(spec, server.home, freeze, thaw)


@pytest.mark.slow
async def test_a_frozen_sshd_is_lost_in_bounded_time_and_its_attempt_fences_itself(
    sshd: RealSshd,  # noqa: F811
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
) -> None:
    """Given a job running behind OpenSSH's sshd, when every sshd process is stopped
    (SIGSTOP: a hung VM), then the VM is unreachable within 15 s, the job is node_lost
    within 30 s and runs elsewhere, the old attempt having stopped itself first."""
    fleet = await sim_fleet(1)
    python = write_fake_python(tmp_path)
    await partition(db, nats.url, _frozen_sshd(sshd, python), fleet[0], python)


@pytest.mark.slow
async def test_a_10s_frozen_sshd_restarts_nothing(
    sshd: RealSshd,  # noqa: F811
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
) -> None:
    """Given a job running behind sshd, when sshd is frozen for 10 s, then nothing is
    restarted or fenced."""
    fleet = await sim_fleet(1)
    python = write_fake_python(tmp_path)
    await blip(db, nats.url, _frozen_sshd(sshd, python), fleet[0], python)


def test_the_default_settings_keep_the_documented_bounds() -> None:
    """The defaults are consistent, and they bound a silent VM as documented."""
    knobs = Liveness()
    assert knobs.problems() == []
    # Unreachable: last answer + unreachable timeout, seen by the next sweep at the latest.
    assert knobs.unreachable_timeout_s + knobs.poll_interval_s <= UNREACHABLE_BOUND_S
    # node_lost: last answer + node-lost timeout, seen by the next requeue tick.
    assert knobs.node_lost_timeout_s + RequeueConfig().interval_s <= NODE_LOST_BOUND_S
    unsafe = dataclasses.replace(knobs, node_lost_timeout_s=knobs.fence_after_s)
    assert any("node-lost timeout" in p for p in unsafe.problems())
