"""The dispatcher against real Postgres, real NATS JetStream and real SSH servers (the
test fleet); only the GPUs are simulated."""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import func, select, update

from scheduler import bus
from scheduler.claims.leases import expire_leases
from scheduler.control import CancelResult, cancel_job
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats, free_port
from scheduler.models import GPU, Job, JobEvent, Leftover
from scheduler.remote.layout import job_base
from scheduler.requeue import RequeueManager
from scheduler.transport import CommandResult, Transport, VMTarget, make_transport
from tests.backdate import age_lease
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    add_vm_row,
    attempt_dirs,
    current_attempt,
    installation,
    job_attempt_dir,
    job_row,
    new_job,
    polled_fleet,
    publish,
    running_dispatcher,
    wait_file,
    wait_status,
)

FleetFactory = Callable[..., Awaitable[SimFleet]]


async def test_a_published_job_runs_on_the_gpus_it_claimed(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given one VM with two GPUs, when a user's script publishes a 1-GPU job id with a
    plain `nc.publish`, then the job is running with the pid of its process-group leader,
    its attempt directory holds the contract's files, the process sees only its GPU,
    and the arguments arrived verbatim."""
    fleet, ids = await polled_fleet(sim_fleet, db, 1, 2)
    home = fleet[0].home
    extra = ("--max_steps", "3", "--note", "it's $(not) a `command`")
    job_id = await new_job(db, 1, extra, reward_functions=("format", "mod:fn"))
    async with running_dispatcher(db, nats.url):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        job = await wait_status(db, job_id, "running")

    d = await job_attempt_dir(db, job_id, home)
    assert str(d) == job.attempt_dir
    assert (job.vm_id, job.gpu_indices, job.attempt) == (ids["vm0"], [0], 1)
    assert job.lease_expires_at is None and job.running_at is not None
    assert int((d / "pid").read_text()) == job.remote_pid
    assert (await wait_file(d / "exit_code")).strip() == "0"
    log = (d / "train.log").read_text()
    assert f"CUDA_VISIBLE_DEVICES={fleet[0].gpu_uuids[0]}\n" in log
    assert job.gpu_uuids == fleet[0].gpu_uuids[:1]
    outputs = f"{home}/.rlfleet/{await installation(db)}/outputs/{job_id}"
    argv = [
        "--model", "tiny", "--dataset", "data.jsonl", "--reward_function", "format",
        "--reward_function", "mod:fn", "--output_dir", outputs,
        *extra,
    ]  # fmt: skip
    assert f"args={argv!r}" in log
    assert json.loads((d / "progress.json").read_text())["status"] == "finished"
    assert (d / "launch.sh").exists()
    async with db.transaction() as session:
        moves = (
            await session.execute(
                select(JobEvent.from_status, JobEvent.to_status).where(JobEvent.job_id == job_id)
            )
        ).all()
    assert [tuple(m) for m in moves] == [
        (None, "queued"),
        ("queued", "starting"),
        ("starting", "running"),
    ]


async def test_duplicates_unknown_and_malformed_messages(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a job published three times, an unknown id, a cancelled job, and payloads
    that are not job ids, then the job is launched once, nothing else happens, and every
    message is acked or terminated (the work queue ends empty)."""
    fleet, _ = await polled_fleet(sim_fleet, db, 1, 2)
    job_id = await new_job(db, 1, ("--fake_seconds", "1"))
    cancelled = await new_job(db)
    async with db.transaction() as session:
        await session.execute(update(Job).where(Job.id == cancelled).values(status="cancelled"))
    async with running_dispatcher(db, nats.url) as dispatcher:
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id, job_id, 987654, cancelled, b"\xff\xfe", b"12abc", b"", job_id)
        await wait_status(db, job_id, "running")
        js = nc.jetstream()
        for _ in range(100):
            info = await js.consumer_info(bus.STREAM, bus.CONSUMER)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        stream = await js.stream_info(bus.STREAM)
        await nc.close()

    assert (info.num_pending, info.num_ack_pending, stream.state.messages) == (0, 0, 0)
    assert dispatcher.stats.launched == 1
    assert dispatcher.stats.terminated == 3
    assert dispatcher.stats.skipped == 4  # two repeats, the unknown id, the cancelled job
    base = fleet[0].home / job_base(await installation(db), job_id)
    run = await current_attempt(db, job_id)
    assert [p.name for p in base.iterdir()] == [f"1-{run.token}"]
    assert (await job_row(db, cancelled)).status == "cancelled"


async def test_a_job_that_fits_nowhere_is_pending_with_the_reason(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given two VMs with two GPUs each (and a 4-GPU one that is unreachable), a 4-GPU
    job is pending and says why, naming the unreachable VM."""
    await polled_fleet(sim_fleet, db, 2, 2)
    await add_vm_row(db, "big", 4, status="unreachable")
    job_id = await new_job(db, 4)
    async with running_dispatcher(db, nats.url):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        job = await wait_status(db, job_id, "pending")
    assert job.status_reason == "needs 4 GPUs, largest free block is 2 (big: unreachable)"


@pytest.mark.slow
async def test_a_multi_gpu_job_starts_through_accelerate(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a 2-GPU job, the VM runs it with `accelerate launch --num_processes 2` on the
    two claimed GPUs (the real accelerate launcher, contract 5)."""
    fleet, _ = await polled_fleet(sim_fleet, db, 1, 3)
    job_id = await new_job(db, 2)
    async with running_dispatcher(db, nats.url):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        await wait_status(db, job_id, "running")
    d = await job_attempt_dir(db, job_id, fleet[0].home)
    assert (await wait_file(d / "exit_code", timeout=60)).strip() == "0"
    launch = (d / "launch.sh").read_text()
    assert "-m accelerate.commands.launch --num_processes 2 " + shlex.quote(str(FAKE_TRAIN)) in (
        launch
    )
    wanted = ",".join(fleet[0].gpu_uuids[:2])
    assert f"CUDA_VISIBLE_DEVICES={wanted}\n" in (d / "train.log").read_text()


async def test_an_unreachable_vm_fails_the_launch_and_frees_the_claim(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a VM that stops answering SSH after its last poll, the job fails with
    `launch_failed` (retryable), its GPUs leave the job, and they stay blocked (a stale
    process row) until that attempt is known not to run there."""
    fleet, ids = await polled_fleet(sim_fleet, db, 1, 1)
    await fleet[0].stop()
    job_id = await new_job(db)
    async with running_dispatcher(db, nats.url):
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        job = await wait_status(db, job_id, "failed")
    assert job.failure_reason == "launch_failed"
    assert job.next_attempt_at is None and "launch failed" in (job.status_reason or "")
    async with db.transaction() as session:
        assert await session.scalar(select(func.count()).where(GPU.job_id.is_not(None))) == 0
        stale = (await session.execute(select(Leftover))).scalars().one()
    assert (stale.vm_id, stale.job_id, stale.attempt, stale.gpu_indices) == (
        ids["vm0"],
        job_id,
        1,
        [0],
    )


class StallingTransport:
    """Forwards everything except launches, which hang: a dispatcher about to die."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.launch_started = asyncio.Event()

    async def run(
        self, target: VMTarget, command: str, *, timeout: float, input: str | None = None
    ) -> CommandResult:
        if ".launch.lock" in command:
            self.launch_started.set()
            await asyncio.sleep(3600)
        return await self.inner.run(target, command, timeout=timeout, input=input)

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.slow
async def test_a_dispatcher_dying_between_claim_and_launch_blocks_nothing_for_ever(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a dispatcher that claims a job and dies before launching, then the job holds
    a lease that expires; `expire_leases` frees the claim and requeues the job. A healthy
    dispatcher does not run it while attempt 1 may still start; once the requeue manager's
    kill has fenced attempt 1 off, it runs as attempt 2."""
    fleet, _ = await polled_fleet(sim_fleet, db, 1, 2)
    job_id = await new_job(db)
    stalling = StallingTransport(make_transport())
    nc = await nats_client.connect(nats.url)
    async with running_dispatcher(db, nats.url, transport=stalling, lease_s=1.0) as doomed:
        await publish(nc, job_id)
        await asyncio.wait_for(stalling.launch_started.wait(), 10)
        job = await job_row(db, job_id)
        for task in list(doomed.consumer._tasks):  # the process dies: its work is gone
            task.cancel()
    await stalling.close()
    assert job.status == "starting" and job.lease_expires_at is not None
    assert job.lease_expires_at > job.starting_at

    await age_lease(db, job_id, 1.2)  # as 1.2 s later: the 1 s lease has run out
    async with db.transaction() as session:
        expired = (
            await session.scalars(
                select(Job.id).where(Job.status == "starting", Job.lease_expires_at < func.now())
            )
        ).all()
    assert expired == [job_id]
    assert await expire_leases(db) == [job_id]
    assert (await job_row(db, job_id)).status == "queued"

    transport = make_transport()
    async with running_dispatcher(db, nats.url, transport=transport) as healthy:
        await publish(nc, job_id)
        for _ in range(200):
            if healthy.stats.nak:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the dispatcher never deferred the job")
        assert (await job_row(db, job_id)).status == "queued"
        report = await RequeueManager(db, None, transport).tick()
        assert report.killed == [job_id]
        job = await wait_status(db, job_id, "running")
    await transport.close()
    await nc.close()
    assert job.attempt == 2
    [attempt_1] = attempt_dirs(fleet[0].home, await installation(db), job_id, 1)
    assert (attempt_1 / "fenced").exists() and not (attempt_1 / "pid").exists()


@pytest.mark.parametrize("payload", [b"\xff", b"-3", b"1e9", b"99999999999999999999999"])
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    """Only a decimal id in range is a job id."""
    from scheduler.dispatcher.consumer import parse_job_id

    with pytest.raises(ValueError):
        parse_job_id(payload)
    assert parse_job_id(b" 42\n") == 42


class AroundLaunch:
    """A transport that runs `before` / `after` around the first launch command it sends:
    a user acting while that launch is on the wire."""

    def __init__(
        self,
        inner: Transport,
        *,
        before: Callable[[], Awaitable[None]] | None = None,
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.inner = inner
        self.before, self.after = before, after
        self.done = False

    async def run(
        self, target: VMTarget, command: str, *, timeout: float, input: str | None = None
    ) -> CommandResult:
        hooked = ".launch.lock" in command and not self.done
        self.done = self.done or hooked
        if hooked and self.before is not None:
            await self.before()
        result = await self.inner.run(target, command, timeout=timeout, input=input)
        if hooked and self.after is not None:
            await self.after()
        return result

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.slow
async def test_cancelled_during_launch_is_killed_not_run(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    """Given a job cancelled while its launch is on the wire, the dispatcher loses the
    starting → running move and kills the process it just started."""
    fleet, _ = await polled_fleet(sim_fleet, db, 1, 1)
    job_id = await new_job(db, 1, ("--fake_seconds", "30"))

    async def cancel_behind_its_back() -> None:
        async with db.transaction() as session:
            await session.execute(update(Job).where(Job.id == job_id).values(status="cancelled"))

    transport = AroundLaunch(make_transport(), after=cancel_behind_its_back)
    async with running_dispatcher(db, nats.url, transport=transport, kill_grace_s=2) as d:
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        await wait_status(db, job_id, "cancelled")
        attempt_1 = await job_attempt_dir(db, job_id, fleet[0].home)
        code = await wait_file(attempt_1 / "exit_code")
    await transport.close()
    assert code.strip() == "143"
    assert d.stats.launched == 0


async def test_a_cancel_that_beats_the_launch_fences_it_off(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a job cancelled after its claim but before its launch reached the VM, the
    cancel's kill fences the attempt off, so the late launch starts nothing; the GPUs are
    free at once (the stale-process row is closed) and the dispatcher records no run."""
    fleet, _ = await polled_fleet(sim_fleet, db, 1, 1)
    job_id = await new_job(db, 1, ("--fake_seconds", "30"))
    plain = make_transport()
    cancelled: list[CancelResult] = []

    async def cancel() -> None:
        cancelled.append(await cancel_job(db, plain, job_id, actor="test"))

    transport = AroundLaunch(make_transport(), before=cancel)
    async with running_dispatcher(db, nats.url, transport=transport) as d:
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        for _ in range(400):
            if d.stats.skipped or d.stats.launch_failed or d.stats.launched:
                break
            await asyncio.sleep(0.05)
    await transport.close()
    await plain.close()
    assert [(c.kill, c.dead) for c in cancelled] == [("fenced", True)]
    assert (d.stats.skipped, d.stats.launched, d.stats.launch_failed) == (1, 0, 0)
    attempt_dir = await job_attempt_dir(db, job_id, fleet[0].home)
    assert (attempt_dir / "fenced").exists()
    assert not (attempt_dir / "pid").exists() and not (attempt_dir / "train.log").exists()
    job = await job_row(db, job_id)
    assert job.status == "cancelled"
    async with db.transaction() as session:
        assert await session.scalar(select(func.count()).where(GPU.job_id.is_not(None))) == 0
        stale = (await session.execute(select(Leftover))).scalars().one()
        assert (stale.job_id, stale.reason) == (job_id, "cancelled")
        assert stale.killed_at is not None


@pytest.mark.slow
async def test_an_unreachable_database_naks_and_the_job_is_not_lost(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats
) -> None:
    """Given a dispatcher whose database cannot be reached, the message is nak'ed (not
    acked, not lost); once the database answers again the redelivery runs the job."""
    await polled_fleet(sim_fleet, db, 1, 1)
    job_id = await new_job(db)
    dead = Database(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothing")
    async with running_dispatcher(db, nats.url) as dispatcher:
        healthy, dispatcher.db = dispatcher.db, dead
        nc = await nats_client.connect(nats.url)
        await publish(nc, job_id)
        await nc.close()
        for _ in range(200):
            if dispatcher.stats.nak:
                break
            await asyncio.sleep(0.05)
        assert dispatcher.stats.nak >= 1
        assert (await job_row(db, job_id)).status == "queued"
        dispatcher.db = healthy
        job = await wait_status(db, job_id, "running")
    await dead.dispose()
    assert job.attempt == 1
