"""Poller shares: any number of pollers divide the VMs between them, Postgres the only
coordinator (no new service).

Each running poller has a row in `pollers`, renewed every `renew_every_s` (a quarter of
its lease); each VM names the poller that holds it (`vms.poller_id`). A poller polls only
the VMs it holds, and only while its lease is valid by its own clock. So each VM is polled
by exactly one live poller per sweep:

- **Lease.** A renewal succeeds only while the row's lease has not run out
  (`renewed_at > now() - lease_s`, database time); the poller then counts its lease valid
  until `lease_s` after the moment it *sent* the renewal (its monotonic clock, earlier than
  the database's `now()` of that renewal). Another poller may free its VMs only once
  `renewed_at + lease_s` is past by the database's clock, so after the holder has stopped
  starting polls on them. A lease that ran out is never renewed: the row is deleted by
  whichever poller sees it first, which frees its VMs (a VM whose `poller_id` names no
  live row is free), and the poller that comes back registers anew, holding nothing, and
  takes only VMs nobody holds.
- **Division.** Each renewal computes the fair share `ceil(VMs / live pollers)`; a
  poller holding more releases its excess (highest ids), one holding less takes free VMs.
  Every lock a renewal takes on another's rows is `FOR UPDATE SKIP LOCKED`: it never waits
  on a VM row a sweep is writing nor on a poller row being renewed, so renewals and sweeps
  cannot deadlock (`vms.poller_id` has no foreign key for the same reason: its checks
  would lock poller rows from every sweep). Pollers or VMs that come and go are
  rebalanced within a renewal or two.
- **Takeover.** A poller that dies or is cut off from Postgres loses its VMs within one
  lease (plus one renewal of a survivor); a VM taken (or added) is polled at once, not at
  the taker's next sweep, so it is never left unpolled for longer than
  `poll_interval + lease + renew_every` (`Liveness.problems` keeps that below the
  unreachable timeout).

The renewal is one short transaction of its own (invariant 4: no SSH or NATS inside). The
daemon renews from a thread of its own (`Keeper`, with its own event loop and database
connection), so a sweep that keeps the poller's event loop busy for a while (thousands of
polls landing at once on a loaded host) never starves the lease.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import text

from scheduler.db import Database
from scheduler.logging import get_logger

log = get_logger("gpu_poller")

RENEWALS_PER_LEASE = 4
"""A poller renews its lease this many times per lease period: a renewal or two may be
slow or fail without the lease running out."""

_RENEW_SQL = text(
    """
UPDATE pollers SET renewed_at = now()
WHERE id = :id AND renewed_at > now() - make_interval(secs => lease_s)
RETURNING id
"""
)
_REGISTER_SQL = text("INSERT INTO pollers (name, lease_s) VALUES (:name, :lease) RETURNING id")
# Deleting a poller frees its VMs (a poller_id naming no row is free). A row being
# renewed right now is skipped: its renewal decides.
_REAP_SQL = text(
    """
DELETE FROM pollers WHERE id IN (
    SELECT id FROM pollers WHERE renewed_at < now() - make_interval(secs => lease_s)
    FOR UPDATE SKIP LOCKED)
RETURNING id, name
"""
)
_COUNTS_SQL = text("SELECT (SELECT count(*) FROM pollers), (SELECT count(*) FROM vms)")
_HELD_SQL = text("SELECT id FROM vms WHERE poller_id = :id ORDER BY id")
# A row a sweep is writing is skipped (released at a later renewal), never waited on.
_RELEASE_SQL = text(
    """
UPDATE vms SET poller_id = NULL
WHERE id IN (SELECT id FROM vms WHERE poller_id = :id AND id = ANY(:ids)
             FOR UPDATE SKIP LOCKED)
RETURNING id
"""
)
_CLAIM_SQL = text(
    """
UPDATE vms SET poller_id = :id
WHERE id IN (SELECT v.id FROM vms v
             WHERE v.poller_id IS NULL
                OR NOT EXISTS (SELECT 1 FROM pollers p WHERE p.id = v.poller_id)
             ORDER BY v.id LIMIT :n
             FOR UPDATE OF v SKIP LOCKED)
RETURNING id
"""
)
_LEAVE_SQL = text("DELETE FROM pollers WHERE id = :id")


def default_name() -> str:
    """`host:pid` of this process: who a VM's poller is, for people."""
    return f"{socket.gethostname()}:{os.getpid()}"[:255]


@dataclass(frozen=True)
class Renewal:
    """What one renewal did."""

    held: frozenset[int]
    taken: frozenset[int]
    """VMs this renewal took (free ones, or ones a dead poller held): poll them now."""
    released: frozenset[int]
    pollers: int
    """Live pollers, this one included."""
    reaped: tuple[str, ...] = ()
    """Names of the pollers whose lease ran out (deleted, their VMs freed)."""


class Shares:
    """This poller's lease and the VMs it holds."""

    def __init__(self, db: Database, *, lease_s: float, name: str | None = None) -> None:
        if not 0 < lease_s <= 3600:
            raise ValueError(f"poller lease must be in (0, 3600] seconds, not {lease_s:g}")
        self.db = db
        self.lease_s = lease_s
        self.name = name or default_name()
        self.id: int | None = None
        self.held: frozenset[int] = frozenset()
        self.pollers = 0
        self.valid_until = 0.0
        """Monotonic time until which the lease is surely valid."""

    @property
    def renew_every_s(self) -> float:
        """How often `renew` should run."""
        return self.lease_s / RENEWALS_PER_LEASE

    def valid(self, now: float | None = None) -> bool:
        """Whether the lease is still valid by this process's clock: its VMs are its to
        poll. Once it may have run out, another poller may hold them."""
        return (time.monotonic() if now is None else now) < self.valid_until

    def holds(self, vm_id: int) -> bool:
        """Whether this poller may poll (and record a poll of) `vm_id` now."""
        return vm_id in self.held and self.valid()

    def mine(self) -> frozenset[int]:
        """The VMs to poll now: those held, or none once the lease may have run out."""
        return self.held if self.valid() else frozenset()

    async def renew(self) -> Renewal:
        """Renew the lease (or register anew once it ran out), free the VMs of pollers
        whose lease ran out, and take or release VMs toward the fair share; one short
        transaction. Raises what the database raises (the lease then runs out unless a
        later renewal succeeds in time)."""
        sent = time.monotonic()
        reaped: list[str] = []
        async with self.db.transaction() as session:
            lost = False
            if self.id is not None:
                renewed = (await session.execute(_RENEW_SQL, {"id": self.id})).first()
                if renewed is None:
                    lost = True
                    self.id = None
            if self.id is None:
                self.id = int(
                    (
                        await session.execute(
                            _REGISTER_SQL, {"name": self.name, "lease": self.lease_s}
                        )
                    ).scalar_one()
                )
            for _id, name in (await session.execute(_REAP_SQL)).all():
                reaped.append(name)
            pollers, vms = (await session.execute(_COUNTS_SQL)).one()
            share = math.ceil(vms / max(1, pollers))
            held = [int(i) for i in (await session.execute(_HELD_SQL, {"id": self.id})).scalars()]
            released: list[int] = []
            taken: list[int] = []
            if len(held) > share:
                released = [
                    int(i)
                    for i in (
                        await session.execute(_RELEASE_SQL, {"id": self.id, "ids": held[share:]})
                    ).scalars()
                ]
                gone = set(released)
                held = [i for i in held if i not in gone]
            elif len(held) < share:
                taken = [
                    int(i)
                    for i in (
                        await session.execute(_CLAIM_SQL, {"id": self.id, "n": share - len(held)})
                    ).scalars()
                ]
                held += taken
        if lost:
            log.warning("poller_lease_lost", poller=self.name, lease_s=self.lease_s)
        for name in reaped:
            log.warning("poller_lease_expired", poller=name, taken_over_by=self.name)
        previous = self.held if not lost else frozenset()
        self.held = frozenset(held)
        self.pollers = int(pollers)
        self.valid_until = sent + self.lease_s
        # VMs new to this poller (taken now, or kept from a lease it lost and got back).
        fresh = self.held - previous
        if taken or released:
            log.info(
                "poller_share_changed",
                poller=self.name,
                held=len(self.held),
                taken=len(taken),
                released=len(released),
                pollers=pollers,
            )
        return Renewal(
            held=self.held,
            taken=frozenset(fresh),
            released=frozenset(released),
            pollers=int(pollers),
            reaped=tuple(reaped),
        )

    async def leave(self) -> None:
        """Give the VMs back at once (a clean stop): the others take them at their next
        renewal instead of after the lease runs out."""
        poller_id, self.id = self.id, None
        self.held = frozenset()
        self.valid_until = 0.0
        if poller_id is None:
            return
        async with self.db.transaction() as session:
            await session.execute(_LEAVE_SQL, {"id": poller_id})


class Keeper:
    """Renews a poller's lease every `shares.renew_every_s` from a thread of its own, with
    its own event loop and a database connection of its own (to `url`); `on_renewal` is
    called in that thread after each successful renewal. `stop` gives the VMs back."""

    def __init__(
        self, shares: Shares, url: str, on_renewal: Callable[[Renewal], None] | None = None
    ) -> None:
        self.shares = shares
        self.url = url
        self.on_renewal = on_renewal
        self.tried = threading.Event()
        """Set once the first renewal was tried (whatever its outcome)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poller-lease", daemon=True)

    def start(self) -> None:
        """Start renewing."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop renewing and leave (the VMs go back at once); waits for the thread."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        db = Database(self.url, pool_size=1)
        self.shares.db = db
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    renewal = await self.shares.renew()
                except Exception as exc:  # noqa: BLE001 - Postgres down: the lease may run out
                    log.error(
                        "poller_renew_failed",
                        poller=self.shares.name,
                        error=f"{type(exc).__name__}: {exc}"[:300],
                        lease_left_s=round(max(0.0, self.shares.valid_until - time.monotonic()), 2),
                    )
                else:
                    if self.on_renewal is not None:
                        self.on_renewal(renewal)
                self.tried.set()
                until = started + self.shares.renew_every_s
                while not self._stop.is_set() and (left := until - time.monotonic()) > 0:
                    await asyncio.sleep(min(left, 0.1))
            try:
                await self.shares.leave()
            except Exception as exc:  # noqa: BLE001 - the lease runs out by itself
                log.warning("poller_leave_failed", error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            self.tried.set()
            await db.dispose()
