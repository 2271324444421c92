"""Three pollers share the fleet as separate processes (`python -m scheduler.gpu_poller`);
one is killed with SIGKILL mid-run. Its VMs must be polled by the other two within one
lease period, no VM may go unpolled for as long as the unreachable timeout, and no job on
them may be declared lost (nor any VM marked unreachable). Then one of the two is cut off
(SIGSTOP) past its lease and comes back: its VMs go to the other, and it shares the VMs
again under a new lease, its old one never renewed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from scheduler.db import Database
from scheduler.models import VM, Job, JobEvent, Poller
from scheduler.transport import Transport
from tests.acceptance.chaos import Daemon
from tests.fleet import SimFleet
from tests.workloads.support import launch_on

FleetFactory = Callable[..., Awaitable[SimFleet]]
N_VMS = 9
INTERVAL_S = 1.0
UNREACHABLE_S = 5.0
LEASE_S = 0.6 * (UNREACHABLE_S - INTERVAL_S)  # the default: 0.6 x (unreachable - interval)


async def snapshot(db: Database) -> list[tuple[int, int | None, str, float | None]]:
    """(vm id, poller id, status, seconds since last answer) by the database's clock."""
    async with db.transaction() as session:
        rows = await session.execute(
            text(
                "SELECT id, poller_id, status, "
                "EXTRACT(EPOCH FROM now() - last_seen_at)::float8 AS age FROM vms ORDER BY id"
            )
        )
        return [(r.id, r.poller_id, r.status, r.age) for r in rows]


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_a_killed_poller_s_vms_are_taken_over_within_one_lease(
    db: Database,
    database_url: str,
    transport: Transport,
    sim_fleet: FleetFactory,
    tmp_path: Path,
) -> None:
    fleet = await sim_fleet(N_VMS)
    ids = await fleet.register(db)
    env = {**os.environ, "RLFLEET_HISTORY_DAYS": "1"}
    argv = [
        sys.executable,
        "-m",
        "scheduler.gpu_poller",
        "--database-url",
        database_url,
        "--interval",
        str(INTERVAL_S),
        "--unreachable-timeout",
        str(UNREACHABLE_S),
    ]
    pollers = [Daemon(f"poller-{i}", argv, tmp_path, env) for i in range(3)]
    for p in pollers:
        p.start()
    try:
        # Given three pollers holding three VMs each, every VM healthy
        async def divided() -> bool:
            rows = await snapshot(db)
            per = Counter(r[1] for r in rows)
            return (
                all(r[2] == "healthy" for r in rows)
                and None not in per
                and sorted(per.values()) == [3, 3, 3]
            )

        await wait_until(divided, 90, "three pollers holding three healthy VMs each")
        # and a running job on every VM
        jobs = [
            await launch_on(db, transport, vm.target(ids[vm.name]), 0, "--fake_seconds", "600")
            for vm in fleet
        ]
        async with db.transaction() as session:
            names = dict((await session.execute(select(Poller.id, Poller.name))).all())
        by_pid = {int(name.rsplit(":", 1)[1]): pid for pid, name in names.items()}
        victim = pollers[0]
        assert victim.proc is not None
        victim_id = by_pid[victim.proc.pid]
        victim_vms = {r[0] for r in await snapshot(db) if r[1] == victim_id}
        assert len(victim_vms) == 3

        # A sampler records the longest any VM went without an answer, and any VM ever
        # unreachable, from now until the end.
        worst: dict[int, float] = {}
        unreachable: set[int] = set()
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                for vm_id, _, status, age in await snapshot(db):
                    worst[vm_id] = max(worst.get(vm_id, 0.0), age or 0.0)
                    if status == "unreachable":
                        unreachable.add(vm_id)
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        await asyncio.sleep(2 * INTERVAL_S)

        # When one poller is killed (SIGKILL: no clean leave, its lease must run out)
        victim.kill9()
        killed_at = time.monotonic()

        # Then its VMs are held by the two others within one lease (plus one renewal)
        async def taken_over() -> bool:
            rows = {r[0]: r for r in await snapshot(db)}
            return all(rows[v][1] not in (None, victim_id) for v in victim_vms)

        await wait_until(taken_over, 30, "the killed poller's VMs to be taken over")
        took = time.monotonic() - killed_at
        # and polled by them: each answers again after the kill
        await asyncio.sleep(3 * INTERVAL_S)
        done.set()
        await sampler
        async with db.transaction() as session:
            statuses = set((await session.execute(select(Job.status))).scalars())
            lost = await session.scalar(
                select(func.count()).select_from(JobEvent).where(JobEvent.reason == "node_lost")
            )
            remaining = set((await session.execute(select(VM.poller_id))).scalars())
        print(
            f"takeover after {took:.2f}s (lease {LEASE_S:.2f}s); longest without an answer: "
            f"{max(worst.values()):.2f}s (unreachable timeout {UNREACHABLE_S:g}s)"
        )
        assert took <= LEASE_S + LEASE_S / 4 + 1.0, took
        assert max(worst.values()) < UNREACHABLE_S, worst
        assert not unreachable, unreachable
        assert statuses == {"running"} and lost == 0 and len(jobs) == N_VMS
        assert victim_id not in remaining and len(remaining) == 2

        # When a second poller is cut off (SIGSTOP: it neither renews nor polls) and
        # comes back after its lease ran out
        cut = pollers[1]
        assert cut.proc is not None
        cut_id = by_pid[cut.proc.pid]
        cut_vms = {r[0] for r in await snapshot(db) if r[1] == cut_id}
        os.kill(cut.proc.pid, signal.SIGSTOP)
        try:

            async def taken_from_cut() -> bool:
                rows = {r[0]: r for r in await snapshot(db)}
                return all(rows[v][1] not in (None, cut_id) for v in cut_vms)

            await wait_until(taken_from_cut, 30, "the cut-off poller's VMs to be taken over")
        finally:
            os.kill(cut.proc.pid, signal.SIGCONT)

        # Then it holds none of its old VMs under its old lease (that lease is gone: it
        # registers anew), and the two share the VMs again: a new row, no VM free
        async def shared_again() -> bool:
            rows = await snapshot(db)
            per = Counter(r[1] for r in rows)
            return None not in per and len(per) == 2 and cut_id not in per

        await wait_until(shared_again, 30, "the returning poller to share the VMs again")
        async with db.transaction() as session:
            live = set((await session.execute(select(Poller.id))).scalars())
        assert cut_id not in live and len(live) == 2
        assert "poller_lease_lost" in cut.tail(200)
    finally:
        codes = [p.stop() for p in pollers[1:]]
        for p in pollers:
            p.kill9()
    assert codes == [0, 0], [p.tail() for p in pollers]
