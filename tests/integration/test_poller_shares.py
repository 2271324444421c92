"""Pollers share the fleet (scheduler.gpu_poller.shares) on real Postgres and real SSH VMs:
the division, takeover of an expired lease, a returning poller holding nothing another
holds, and sweeps that poll only the poller's own VMs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

from prometheus_client import generate_latest
from sqlalchemy import func, insert, select, update

from scheduler import fleet
from scheduler.db import Database
from scheduler.gpu_poller import GpuPoller
from scheduler.gpu_poller.shares import Shares
from scheduler.liveness import Liveness
from scheduler.models import VM, Poller
from scheduler.transport import SSHTransport, Transport
from tests.fleet import SimFleet

FleetFactory = Callable[..., Awaitable[SimFleet]]


async def add_vms(db: Database, n: int) -> None:
    async with db.transaction() as session:
        await session.execute(insert(VM), [{"name": f"vm{i}", "host": "h"} for i in range(n)])


async def holders(db: Database) -> dict[int, int | None]:
    async with db.transaction() as session:
        return dict((await session.execute(select(VM.id, VM.poller_id))).all())


async def age_poller(db: Database, poller_id: int, seconds: float) -> None:
    """Make the poller's last renewal `seconds` older (its lease runs out)."""
    async with db.transaction() as session:
        await session.execute(
            update(Poller)
            .where(Poller.id == poller_id)
            .values(renewed_at=Poller.renewed_at - timedelta(seconds=seconds))
        )


async def test_pollers_divide_the_vms_and_rebalance(db: Database) -> None:
    # Given 10 VMs and one poller: it holds them all
    await add_vms(db, 10)
    a, b, c = (Shares(db, lease_s=30, name=n) for n in "abc")
    assert len((await a.renew()).held) == 10
    # When a second and a third poller join, each renewing a couple of times
    await b.renew()
    await c.renew()
    for _ in range(2):
        for shares in (a, b, c):
            await shares.renew()
    # Then the VMs are divided (ceil(10/3) = 4 at most each), each held by one poller
    held = [a.held, b.held, c.held]
    assert sorted(len(h) for h in held) == [2, 4, 4] or sorted(len(h) for h in held) == [3, 3, 4]
    assert frozenset().union(*held) == frozenset((await holders(db)).keys())
    assert sum(len(h) for h in held) == 10
    rows = await holders(db)
    for shares in (a, b, c):
        assert all(rows[vm] == shares.id for vm in shares.held)
    # When one stops cleanly, the others take its VMs at their next renewal
    await c.leave()
    await a.renew()
    await b.renew()
    assert len(a.held) + len(b.held) == 10 and not a.held & b.held
    # And a VM added later goes to a poller with room
    await add_vms_named(db, "late")
    renewals = [await a.renew(), await b.renew()]
    late = await vm_id(db, "late")
    assert sum(late in r.taken for r in renewals) == 1


async def add_vms_named(db: Database, name: str) -> None:
    async with db.transaction() as session:
        await session.execute(insert(VM), [{"name": name, "host": "h"}])


async def vm_id(db: Database, name: str) -> int:
    async with db.transaction() as session:
        return int(await session.scalar(select(VM.id).where(VM.name == name)))


async def test_an_expired_lease_is_taken_over_and_its_holder_returns_holding_nothing(
    db: Database,
) -> None:
    # Given two pollers holding 3 VMs each
    await add_vms(db, 6)
    a, b = Shares(db, lease_s=30, name="a"), Shares(db, lease_s=30, name="b")
    await a.renew()
    await b.renew()
    await a.renew()
    await b.renew()
    assert len(a.held) == len(b.held) == 3
    a_vms = a.held
    # When a's lease runs out (a stopped renewing: partitioned, or dead)
    assert a.id is not None
    await age_poller(db, a.id, 31)
    taken = await b.renew()
    # Then b frees a's VMs and takes them all, at once
    assert taken.reaped == ("a",)
    assert a_vms <= taken.taken and len(b.held) == 6
    async with db.transaction() as session:
        assert await session.scalar(select(func.count()).select_from(Poller)) == 1
    # When a comes back: its old lease is never renewed; it registers anew and holds
    # nothing b holds
    back = await a.renew()
    assert back.held == frozenset() and not a.holds(next(iter(a_vms)))
    rows = await holders(db)
    assert all(rows[vm] == b.id for vm in a_vms)
    # and the share evens out only through b releasing VMs, which a then takes
    await b.renew()
    await a.renew()
    assert len(a.held) == len(b.held) == 3 and not a.held & b.held


async def test_a_lease_not_renewed_in_time_holds_nothing_locally() -> None:
    # A poller that cannot renew stops polling its VMs once its lease may have run out
    # by its own clock, before any other poller may take them (no database needed: the
    # local clock decides).
    shares = Shares(None, lease_s=0.3, name="x")  # type: ignore[arg-type]
    shares.held = frozenset({1, 2})
    shares.valid_until = time.monotonic() + 0.3
    assert shares.mine() == {1, 2} and shares.holds(1)
    shares.valid_until = time.monotonic() - 0.001
    assert shares.mine() == frozenset() and not shares.holds(1)


def test_the_default_lease_keeps_a_dead_pollers_vms_polled_within_the_unreachable_timeout() -> None:
    knobs = Liveness()
    assert knobs.takeover_gap_s() < knobs.unreachable_timeout_s
    assert knobs.problems() == []
    assert Liveness(poll_interval_s=0.5).takeover_gap_s() < knobs.unreachable_timeout_s
    # The poller's connections send no keepalive between polls (each poll is one)
    assert knobs.poll_keepalive_s() > knobs.poll_interval_s
    # A lease given explicitly that would leave VMs unpolled too long is refused
    bad = Liveness(poller_lease_s=4).problems()
    assert any("poller lease" in p for p in bad), bad


async def test_sweeps_poll_only_the_pollers_own_vms(
    db: Database, transport: Transport, sim_fleet: FleetFactory
) -> None:
    # Given 4 VMs shared by two pollers
    fleet = await sim_fleet(4)
    await fleet.register(db)
    a, b = Shares(db, lease_s=30, name="a"), Shares(db, lease_s=30, name="b")
    for shares in (a, b, a, b):
        await shares.renew()
    pa = GpuPoller(db, transport, shares=a)
    pb = GpuPoller(db, transport, shares=b)
    # When both sweep
    sa, sb = await asyncio.gather(pa.sweep(), pb.sweep())
    # Then each polled its own two VMs, and every VM was polled
    assert (sa.vms, sa.polled, sb.vms, sb.polled) == (2, 2, 2, 2)
    # and the poller's metrics say so (VMs held, the sweep's wall and CPU time)
    exposed = generate_latest().decode()
    assert "rlfleet_poll_vms_held 2.0" in exposed
    for name in ("rlfleet_poll_sweep_seconds", "rlfleet_poll_sweep_cpu_seconds"):
        value = next(line for line in exposed.splitlines() if line.startswith(name + " "))
        assert float(value.split()[1]) > 0, value
    async with db.transaction() as session:
        rows = (await session.execute(select(VM.status, VM.last_polled_at))).all()
    assert all(r.status == "healthy" and r.last_polled_at is not None for r in rows)
    # When a's lease runs out by its own clock, its sweep polls nothing
    a.valid_until = 0.0
    assert (await pa.sweep()).vms == 0


async def test_vm_show_and_list_say_which_poller_holds_a_vm(
    db: Database, database_url: str
) -> None:
    # Given two VMs, one held by poller "hostA:11", the other by nobody yet
    await add_vms(db, 1)
    shares = Shares(db, lease_s=30, name="hostA:11")
    await shares.renew()
    await add_vms_named(db, "free")
    async with db.transaction() as session:
        shown = fleet.vm_to_dict(await fleet.get_vm(session, "vm0", with_gpus=True))
        listed = {v["name"]: v for v in map(fleet.vm_to_dict, await fleet.list_vms(session))}
    assert shown["poller"] == "hostA:11" and "last_polled_at" in shown
    assert listed["vm0"]["poller"] == "hostA:11" and listed["free"]["poller"] is None
    # And the CLI prints it (vm show, vm list --json)
    env = {**os.environ, "RLFLEET_DATABASE_URL": database_url}
    cli = [sys.executable, "-m", "scheduler.cli"]
    show = await asyncio.to_thread(
        subprocess.run, [*cli, "vm", "show", "vm0"], env=env, capture_output=True, text=True
    )
    assert show.returncode == 0, show.stderr
    assert any(line.split() == ["poller:", "hostA:11"] for line in show.stdout.splitlines()), (
        show.stdout
    )
    assert any(line.startswith("last_polled_at:") for line in show.stdout.splitlines())
    listing = await asyncio.to_thread(
        subprocess.run, [*cli, "vm", "list", "--json"], env=env, capture_output=True, text=True
    )
    assert listing.returncode == 0, listing.stderr
    assert {v["name"]: v["poller"] for v in json.loads(listing.stdout)} == {
        "vm0": "hostA:11",
        "free": None,
    }


async def test_a_renewal_never_waits_on_a_sweep_writing_the_vms(db: Database) -> None:
    # Given poller b holding 3 VMs, whose sweep is writing their rows (updated twice in
    # one open transaction, as a batch's apply does) when b's lease runs out
    await add_vms(db, 3)
    a, b = Shares(db, lease_s=30, name="a"), Shares(db, lease_s=30, name="b")
    await b.renew()
    assert len(b.held) == 3 and b.id is not None
    await age_poller(db, b.id, 31)
    async with db.transaction() as sweep:
        await sweep.execute(update(VM).values(status="healthy"))
        await sweep.execute(update(VM).values(available_gpus=0))
        # When a renews meanwhile, it neither waits on those rows nor deadlocks: it frees
        # b's lease and takes none of the rows being written
        renewal = await asyncio.wait_for(a.renew(), 10)
        assert renewal.reaped == ("b",) and renewal.taken == frozenset()
    # Then, the write committed, a's next renewal takes them
    assert len((await a.renew()).taken) == 3


async def test_a_poller_closes_the_connections_of_the_vms_it_released(
    db: Database, sim_fleet: FleetFactory
) -> None:
    # Given a poller alone, holding and polling 4 VMs over connections of its own
    fleet = await sim_fleet(4)
    await fleet.register(db)
    a = Shares(db, lease_s=30, name="a")
    await a.renew()
    transport = SSHTransport()
    poller = GpuPoller(db, transport, shares=a)
    try:
        assert (await poller.sweep()).polled == 4
        assert transport.open_connections == 4
        # When a second poller joins and a releases half of the VMs to it
        b = Shares(db, lease_s=30, name="b")
        await b.renew()
        await a.renew()
        assert len(a.held) == 2
        # Then a's next sweep polls its two and closes the other two connections
        assert (await poller.sweep()).polled == 2
        assert transport.open_connections == 2
    finally:
        await transport.close()
