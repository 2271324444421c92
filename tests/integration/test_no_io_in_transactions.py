"""Invariant 4: no SSH or NATS call is made while a database transaction is open.

Every database transaction in the process is tracked per asyncio task (SQLAlchemy's
begin / commit / rollback events); every SSH command and every NATS publish (JetStream
publishes, acks and pull requests all go through `Client.publish`) checks that its own
task holds no open transaction. The poller, the dispatcher, the requeue manager and a
cancel then run for real against the SSH test fleet, Postgres and NATS.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats as nats_client
import pytest
from nats.aio.client import Client
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from scheduler.control import cancel_job
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.requeue import NatsPublisher, RequeueConfig, RequeueManager
from scheduler.retry import RetryPolicy
from scheduler.transport import CommandResult, Transport, VMTarget, make_transport
from tests.fleet import SimFleet
from tests.workloads.support import (
    FAKE_TRAIN,
    new_job,
    running_dispatcher,
    wait_status,
    write_fake_python,
)

FleetFactory = Callable[..., Awaitable[SimFleet]]


def _task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


class TransactionWatch:
    """Counts open transactions per asyncio task, and the network calls made in one."""

    def __init__(self) -> None:
        self.open: Counter[int] = Counter()
        self.calls: Counter[str] = Counter()
        self.violations: list[str] = []

    def begin(self, conn: Any) -> None:
        self.open[id(_task())] += 1

    def end(self, conn: Any) -> None:
        key = id(_task())
        self.open[key] = max(0, self.open[key] - 1)

    def network_call(self, kind: str, what: str) -> None:
        self.calls[kind] += 1
        if self.open[id(_task())] > 0:
            self.violations.append(f"{kind} inside a transaction: {what[:80]}")


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[TransactionWatch]:
    """Track transactions on every engine, and check every NATS publish."""
    w = TransactionWatch()
    event.listen(Engine, "begin", w.begin)
    event.listen(Engine, "commit", w.end)
    event.listen(Engine, "rollback", w.end)
    publish = Client.publish

    async def checked_publish(self: Client, subject: str, *args: Any, **kwargs: Any) -> None:
        w.network_call("nats", subject)
        await publish(self, subject, *args, **kwargs)

    monkeypatch.setattr(Client, "publish", checked_publish)
    yield w
    event.remove(Engine, "begin", w.begin)
    event.remove(Engine, "commit", w.end)
    event.remove(Engine, "rollback", w.end)


class CheckedTransport:
    """The real transport, checking that no transaction is open at each command."""

    def __init__(self, inner: Transport, watch: TransactionWatch) -> None:
        self.inner = inner
        self.watch = watch

    async def run(self, target: VMTarget, command: str, **kwargs: Any) -> CommandResult:
        self.watch.network_call("ssh", f"{target.name}: {command}")
        return await self.inner.run(target, command, **kwargs)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
async def transport(watch: TransactionWatch) -> AsyncIterator[CheckedTransport]:
    inner = make_transport(connect_timeout=2.0, login_timeout=2.0)
    checked = CheckedTransport(inner, watch)
    yield checked
    await inner.close()


async def test_the_watch_catches_a_network_call_inside_a_transaction(
    db: Database, watch: TransactionWatch, transport: CheckedTransport, sim_fleet: FleetFactory
) -> None:
    """The detector itself: an SSH command issued inside `db.transaction()` is reported."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    ids = await fleet.register(db)
    target = VMTarget(id=ids[fleet.vms[0].name], **_ssh_fields(fleet.vms[0]))
    async with db.transaction() as session:
        await session.execute(text("SELECT 1"))  # the transaction is really open now
        await transport.run(target, "true", timeout=10)
    await transport.run(target, "true", timeout=10)
    assert watch.calls["ssh"] == 2
    assert len(watch.violations) == 1 and "inside a transaction" in watch.violations[0]


def _ssh_fields(vm: Any) -> dict[str, Any]:
    spec = vm.spec()
    return {
        "name": spec.name,
        "host": spec.host,
        "port": spec.port,
        "user": spec.user,
        "ssh_key_path": spec.ssh_key_path,
        "known_hosts": spec.known_hosts,
    }


@pytest.mark.slow
async def test_poller_dispatcher_requeue_and_cancel_never_do_io_inside_a_transaction(
    db: Database,
    nats: EmbeddedNats,
    sim_fleet: FleetFactory,
    watch: TransactionWatch,
    transport: CheckedTransport,
    tmp_path: Path,
) -> None:
    """Given two VMs and jobs that succeed, fail and get retried, and one that is
    cancelled while running, when every daemon does its work, then not one SSH command or
    NATS publish was issued by a task holding an open transaction."""
    fleet = await sim_fleet(2, gpus_per_vm=2)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    poller = GpuPoller(db, transport, unreachable_after=1)
    nc = await nats_client.connect(nats.url)
    config = RequeueConfig(
        interval_s=0.2, recheck_after_s=0.3, policy=RetryPolicy(base_delay_s=0.1)
    )
    requeue = RequeueManager(db, NatsPublisher(nc), transport, config)
    quick = [await new_job(db, 1, ("--fake_seconds", "0.2")) for _ in range(3)]
    failing = await new_job(db, 1, ("--fake_exit", "1"), max_retries=1)
    long = await new_job(db, 2, ("--fake_seconds", "300"))
    # A job group: its ports are chosen over SSH, then recorded in a transaction of their own.
    from tests.integration.test_groups_fleet import group_roles, new_group, spread_roles

    group = await new_group(db, group_roles(first_s=0.2))
    # A group over both VMs: ports chosen on each, its server's VM killed once it completes.
    spread = await new_job(
        db, 2, nodes=2, roles=spread_roles(first_s=0.2), model="-", dataset="-",
        reward_functions=("-",),
    )  # fmt: skip
    stop = asyncio.Event()

    async def daemons() -> None:
        while not stop.is_set():
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(0.2)

    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            loop = asyncio.create_task(daemons())
            for job_id in [*quick, group]:
                await wait_status(db, job_id, "completed", timeout=60)
            await wait_status(db, long, "running", timeout=60)
            result = await cancel_job(db, transport, long, grace_s=1.0)
            assert result.kill in {"terminated", "killed"}
            await wait_status(db, spread, "completed", timeout=60)  # once `long` left a VM
            for _ in range(600):  # fails, is retried once, fails for good
                failed = await wait_status(db, failing, "failed", timeout=60)
                if failed.retry_count == 1 and (failed.status_reason or "").startswith("gave up"):
                    break
                await asyncio.sleep(0.1)
            assert failed.retry_count == 1, "the failing job was retried once"
            assert failed.status_reason.startswith("gave up"), failed.status_reason
            stop.set()
            await loop
    finally:
        stop.set()
        await nc.close()

    assert watch.calls["ssh"] >= 10 and watch.calls["nats"] >= 10, watch.calls
    assert watch.violations == []
