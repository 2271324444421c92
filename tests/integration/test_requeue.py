"""The requeue manager against real Postgres and real NATS: retries with backoff, giving
up, announcing what was never announced, waking pending jobs, lost nodes, several copies.

Rows are inserted straight into the database; no VM is needed until a leftover process
has to be killed (tests/integration/test_requeue_recovery.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import nats
import pytest
from nats.aio.client import Client as NATS
from sqlalchemy import func, select, update

from scheduler import bus
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.jobs import get_job, transition
from scheduler.models import GPU, VM, Job, Leftover
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.retry import RetryPolicy
from scheduler.states import JobStatus
from tests.workloads.support import add_vm_row, new_job, place_rank0

FAST = RequeueConfig(
    interval_s=0.1,
    pending_timeout_s=3600,
    node_lost_timeout_s=5,
    republish_after_s=3600,
    recheck_after_s=0,
    starvation_after_s=3600,
    policy=RetryPolicy(base_delay_s=0.2, factor=2, max_delay_s=10, jitter=0.0, node_lost_limit=2),
)


@dataclass
class Stream:
    """What reached jobs.new: a pull subscription on the dispatchers' consumer."""

    sub: object

    async def drain(self, wait: float = 0.3) -> list[tuple[int, str]]:
        """Every (job id, Nats-Msg-Id) stored so far, acknowledged."""
        got: list[tuple[int, str]] = []
        while True:
            try:
                msgs = await self.sub.fetch(100, timeout=wait)  # type: ignore[attr-defined]
            except (nats.errors.TimeoutError, TimeoutError):
                return got
            for msg in msgs:
                got.append((int(msg.data), (msg.headers or {}).get("Nats-Msg-Id", "")))
                await msg.ack()


@pytest.fixture
async def nc(nats: EmbeddedNats) -> AsyncIterator[NATS]:
    """A NATS client with the stream and consumer in place."""
    client = await _connect(nats.url)
    await bus.ensure_stream(client.jetstream())
    yield client
    await client.close()


async def _connect(url: str) -> NATS:
    return await nats.connect(url, allow_reconnect=True, max_reconnect_attempts=-1)


@pytest.fixture
async def stream(nc: NATS) -> Stream:
    """The dispatchers' view of jobs.new."""
    sub = await nc.jetstream().pull_subscribe(bus.SUBJECT_NEW, durable=bus.CONSUMER)
    return Stream(sub)


def manager(db: Database, nc: object, config: RequeueConfig = FAST) -> RequeueManager:
    """A requeue manager with no transport (no leftover needs killing in these tests)."""
    return RequeueManager(db, NatsPublisher(nc), None, config)


async def run_on(db: Database, job_id: int, vm_id: int, gpu_indices: list[int]) -> None:
    """Move a job to running on `vm_id` holding `gpu_indices`, as a dispatcher would."""
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=JobStatus.QUEUED,
            to=JobStatus.STARTING,
            reason="test",
            actor="test",
            values={
                "attempt": Job.attempt + 1,
                "vm_id": vm_id,
                "gpu_indices": gpu_indices,
                "published_at": func.now(),
            },
        )
        assert await transition(
            session,
            job_id,
            expected=JobStatus.STARTING,
            to=JobStatus.RUNNING,
            reason="test",
            actor="test",
            values={"remote_pid": 4242},
        )
        await place_rank0(session, job_id)
        await session.execute(
            update(GPU).where(GPU.vm_id == vm_id, GPU.index.in_(gpu_indices)).values(job_id=job_id)
        )


async def fail(db: Database, job_id: int, reason: str, exit_code: int | None) -> None:
    """The poller saw the running attempt end with `exit_code`."""
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=JobStatus.RUNNING,
            to=JobStatus.FAILED,
            reason=f"{reason} (exit {exit_code})",
            actor="poller",
            values={"failure_reason": reason, "exit_code": exit_code},
        )
        await session.execute(update(GPU).where(GPU.job_id == job_id).values(job_id=None))


async def job(db: Database, job_id: int) -> Job:
    """The job row with its events."""
    async with db.transaction() as session:
        return await get_job(session, job_id, with_events=True)


async def tick_until(m: RequeueManager, cond: object, timeout: float = 10.0) -> None:
    """Tick until `await cond()` is true."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await m.tick()
        if await cond():  # type: ignore[operator]
            return
        assert asyncio.get_running_loop().time() < deadline, "condition never met"
        await asyncio.sleep(0.05)


async def test_a_job_inserted_straight_into_the_database_is_announced_once(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given a queued job nobody published, when the manager ticks twice, then jobs.new
    carries it once and published_at is set."""
    job_id = await new_job(db)
    m = manager(db, nc)

    first = await m.tick()
    second = await m.tick()

    assert first.published == [job_id] and second.published == []
    assert await stream.drain() == [(job_id, f"job-{job_id}-a0-g0")]
    assert (await job(db, job_id)).published_at is not None


@pytest.mark.slow
async def test_a_retryable_failure_comes_back_after_backoff_until_retries_run_out(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given a job with max_retries=2 that exits 1 every time, then it is retried twice,
    each time announced, waiting out the backoff, and then it stays failed saying why."""
    vm = await add_vm_row(db, "a", 1)
    job_id = await new_job(db, max_retries=2)
    m = manager(db, nc)
    await m.tick()
    await stream.drain()

    for attempt in (1, 2, 3):
        await run_on(db, job_id, vm, [0])
        await fail(db, job_id, "exit_nonzero", 1)
        report = await m.tick()
        row = await job(db, job_id)
        if attempt == 3:
            break
        # The decision is stamped at once; the retry waits for it.
        assert report.scheduled == [job_id] and report.retried == []
        assert row.status == "failed" and row.next_attempt_at is not None
        wait = (row.next_attempt_at - row.finished_at).total_seconds()
        # Stamped at the tick, which follows the failure by however long a busy machine
        # takes: never sooner than the backoff.
        delay = 0.2 * 2 ** (attempt - 1)
        assert delay <= wait <= delay + 1.0, wait
        assert row.status_reason.startswith(f"exit_nonzero (exit 1): retry {attempt}/2")
        await tick_until(m, lambda: _status_is(db, job_id, "queued"))
        row = await job(db, job_id)
        assert row.retry_count == attempt and row.next_attempt_at is None
        assert [msg_job for msg_job, _ in await stream.drain()] == [job_id]

    assert row.status == "failed" and row.retry_count == 2
    assert row.status_reason == "gave up after 2 retries: exit_nonzero (exit 1)"
    for _ in range(3):
        await m.tick()
    assert (await job(db, job_id)).status == "failed"
    assert await stream.drain() == []
    moves = [(e.from_status, e.to_status) for e in row.events]
    assert moves.count(("failed", "queued")) == 2


async def test_retried_attempts_get_distinct_message_ids(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given a job that failed once, its retry is announced under a new Nats-Msg-Id, so
    JetStream does not drop it as a duplicate of the first announcement."""
    vm = await add_vm_row(db, "a", 1)
    job_id = await new_job(db)
    m = manager(db, nc)
    await m.tick()
    await run_on(db, job_id, vm, [0])
    await fail(db, job_id, "oom", 75)
    await tick_until(m, lambda: _status_is(db, job_id, "queued"))
    await m.tick()
    ids = [msg_id for _, msg_id in await stream.drain()]
    assert len(ids) == 2 and len(set(ids)) == 2


@pytest.mark.parametrize(
    ("reason", "exit_code", "why"),
    [
        ("config_error", 64, "gave up: config_error (exit 64) is permanent, not retried"),
        ("cancelled", None, "gave up: cancelled is permanent, not retried"),
    ],
)
async def test_permanent_failures_are_never_retried(
    db: Database, nc: NATS, reason: str, exit_code: int | None, why: str
) -> None:
    """Given a job that failed with a permanent reason, it stays failed, saying why."""
    vm = await add_vm_row(db, "a", 1)
    job_id = await new_job(db)
    await run_on(db, job_id, vm, [0])
    await fail(db, job_id, reason, exit_code)
    m = manager(db, nc)
    for _ in range(3):
        await m.tick()
        await asyncio.sleep(0.1)
    row = await job(db, job_id)
    assert (row.status, row.retry_count, row.status_reason) == ("failed", 0, why)


async def test_pending_jobs_wake_when_gpus_that_fit_are_free_in_priority_order(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given three pending jobs and a VM with 2 free GPUs, the two that fit best by
    priority then age are queued and announced; the third stays pending."""
    await add_vm_row(db, "a", 2)
    low, high, big = await new_job(db), await new_job(db, priority=5), await new_job(db, gpus=4)
    for job_id in (low, high, big):
        await _set_pending(db, job_id)

    report = await manager(db, nc).tick()

    assert report.unpended == [high, low]
    assert [j for j, _ in await stream.drain()] == [high, low]
    assert (await job(db, big)).status == "pending"


async def test_pending_jobs_are_looked_at_again_after_the_pending_timeout(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given a pending job that fits nowhere, it is announced again once it has waited
    the pending timeout (a stale capacity report must not strand it)."""
    job_id = await new_job(db, gpus=8)
    await _set_pending(db, job_id)
    config = RequeueConfig(**{**FAST.__dict__, "pending_timeout_s": 60})
    m = manager(db, nc, config)
    await _pending_for(db, job_id, 50)
    assert (await m.tick()).unpended == []
    await _pending_for(db, job_id, 61)
    assert (await m.tick()).unpended == [job_id]
    assert [j for j, _ in await stream.drain()] == [job_id]


async def test_a_starving_big_job_holds_back_smaller_ones(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given a 4-GPU job pending for longer than the starvation limit and a 1-GPU job
    behind it, a free GPU does not wake the small one: the GPUs are left for the big one
    (which fits on VM b, unreachable for now)."""
    await add_vm_row(db, "a", 1)
    await add_vm_row(db, "b", 4, status="unreachable")
    big, small = await new_job(db, gpus=4), await new_job(db)
    for job_id in (big, small):
        await _set_pending(db, job_id)
    config = RequeueConfig(**{**FAST.__dict__, "starvation_after_s": 0.0})
    assert (await manager(db, nc, config).tick()).unpended == []
    assert (await job(db, small)).status == "pending"


async def test_a_short_blip_restarts_nothing_but_a_lost_node_fails_its_jobs(
    db: Database, nc: NATS, stream: Stream
) -> None:
    """Given a running job on a VM unreachable for 2 s (timeout 5 s), nothing happens;
    once the outage passes the timeout, the job fails as node_lost, its GPUs are freed
    in the books but blocked by a stale-process row, and it is requeued at once without
    using up a retry."""
    vm = await add_vm_row(db, "a", 2)
    job_id = await new_job(db, max_retries=0)
    await run_on(db, job_id, vm, [1])
    m = manager(db, nc)
    await _unreachable_for(db, vm, 2)
    assert (await m.tick()).node_lost == []
    assert (await job(db, job_id)).status == "running"

    await _unreachable_for(db, vm, 6)
    report = await m.tick()

    assert report.node_lost == [job_id] and report.retried == [job_id]
    row = await job(db, job_id)
    assert (row.status, row.retry_count, row.failure_reason) == ("queued", 0, "node_lost")
    moves = [(e.from_status, e.to_status, e.reason.split(":")[0]) for e in row.events][-2:]
    assert moves == [
        ("running", "failed", "node_lost"),
        ("failed", "queued", "requeued after node_lost (does not count against max_retries)"),
    ]
    async with db.transaction() as session:
        gpus = (await session.execute(select(GPU.index, GPU.job_id))).all()
        stale = (await session.execute(select(Leftover))).scalars().all()
    assert all(job_id_ is None for _, job_id_ in gpus)
    assert [(s.job_id, s.attempt, s.pid, s.gpu_indices, s.killed_at) for s in stale] == [
        (job_id, 1, 4242, [1], None)
    ]
    assert [j for j, _ in await stream.drain()] == [job_id]


async def test_a_job_that_loses_every_node_still_ends(db: Database, nc: NATS) -> None:
    """Given node_lost_limit=2, the third lost node ends the job for good."""
    m = manager(db, nc)
    job_id = await new_job(db)
    for n in range(3):
        vm = await add_vm_row(db, f"v{n}", 1)
        await _set_queued(db, job_id)
        await run_on(db, job_id, vm, [0])
        await _unreachable_for(db, vm, 6)
        await m.tick()
    row = await job(db, job_id)
    assert row.status == "failed" and row.retry_count == 0
    assert row.status_reason == "gave up after 3 lost nodes: node_lost (limit 2)"


async def test_several_managers_at_once_announce_each_job_once(
    db: Database, nc: NATS, stream: Stream, database_url: str
) -> None:
    """Given 30 unannounced jobs and four managers ticking concurrently on their own
    connections, every job reaches jobs.new exactly once."""
    ids = [await new_job(db) for _ in range(30)]
    dbs = [Database(database_url) for _ in range(4)]
    try:
        managers = [manager(d, nc) for d in dbs]
        reports = await asyncio.gather(*(m.tick() for m in managers))
        reports += await asyncio.gather(*(m.tick() for m in managers))
    finally:
        for d in dbs:
            await d.dispose()
    # Two managers may both announce a job (one between the other's publish and its
    # record of it); JetStream drops the second, as both use the same Nats-Msg-Id.
    assert {j for r in reports for j in r.published} == set(ids)
    delivered = Counter(j for j, _ in await stream.drain())
    assert delivered == Counter(ids)


@pytest.mark.slow
async def test_a_publish_lost_while_nats_is_down_is_made_once_it_is_back(
    db: Database, nats: EmbeddedNats
) -> None:
    """Given NATS is down, a tick publishes nothing and leaves the job unannounced; once
    NATS is back, the next tick announces it."""
    client = await _connect(nats.url)
    await bus.ensure_stream(client.jetstream())
    m = manager(db, client)
    job_id = await new_job(db)
    nats.stop()
    try:
        report = await m.tick()
        assert report.published == [] and report.publish_failed == 1
        assert (await job(db, job_id)).published_at is None
    finally:
        nats.start()
    try:
        for _ in range(100):
            if client.is_connected:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the manager's NATS client never reconnected")
        await tick_until(m, lambda: _published(db, job_id))
        sub = await client.jetstream().pull_subscribe(bus.SUBJECT_NEW, durable=bus.CONSUMER)
        assert [j for j, _ in await Stream(sub).drain()] == [job_id]
    finally:
        await client.close()


async def _status_is(db: Database, job_id: int, status: str) -> bool:
    return (await job(db, job_id)).status == status


async def _published(db: Database, job_id: int) -> bool:
    return (await job(db, job_id)).published_at is not None


async def _set_pending(db: Database, job_id: int) -> None:
    async with db.transaction() as session:
        assert await transition(
            session,
            job_id,
            expected=JobStatus.QUEUED,
            to=JobStatus.PENDING,
            reason="no fit",
            actor="test",
            values={"published_at": func.now()},
        )


async def _pending_for(db: Database, job_id: int, seconds: float) -> None:
    """Make the job look pending for `seconds` already, instead of waiting that long."""
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(pending_at=func.now() - timedelta(seconds=seconds))
        )


async def _set_queued(db: Database, job_id: int) -> None:
    async with db.transaction() as session:
        status = (await get_job(session, job_id)).status
        if status != "queued":
            assert await transition(
                session,
                job_id,
                expected=JobStatus(status),
                to=JobStatus.QUEUED,
                reason="t",
                actor="t",
            )


async def _unreachable_for(db: Database, vm_id: int, seconds: float) -> None:
    async with db.transaction() as session:
        await session.execute(
            update(VM)
            .where(VM.id == vm_id)
            .values(
                status="unreachable",
                unreachable_since=func.now() - timedelta(seconds=seconds),
            )
        )


async def test_a_new_failure_after_a_manual_retry_gets_a_decision_of_its_own(
    db: Database, nc: NATS
) -> None:
    """Given a failed job waiting for its retry that a user queued again by hand (the
    old retry time still on the row), when it fails again, then the manager decides
    anew for this failure instead of acting on the stale retry time."""
    vm = await add_vm_row(db, "a", 1)
    job_id = await new_job(db, max_retries=1)
    slow = RequeueConfig(**{**FAST.__dict__, "policy": RetryPolicy(base_delay_s=60, jitter=0)})
    m = manager(db, nc, slow)
    await run_on(db, job_id, vm, [0])
    await fail(db, job_id, "exit_nonzero", 1)
    assert (await m.tick()).scheduled == [job_id]
    async with db.transaction() as session:  # `rlfleet job retry`, done by hand
        assert await transition(
            session, job_id, expected=JobStatus.FAILED, to=JobStatus.QUEUED, reason="t", actor="t"
        )
    await run_on(db, job_id, vm, [0])
    await fail(db, job_id, "oom", 75)

    report = await m.tick()

    row = await job(db, job_id)
    assert report.scheduled == [job_id] and report.retried == []
    assert row.next_attempt_at > row.finished_at
    assert row.status_reason.startswith("oom (exit 75): retry 1/1 in 60s")
