"""`job logs --follow` over real SSH while the log is being written."""

from __future__ import annotations

import asyncio
import os

import pytest
from sqlalchemy import update

from scheduler.db import Database
from scheduler.job_logs import stream_log
from scheduler.models import Job
from scheduler.remote.layout import new_token
from scheduler.transport import make_transport
from tests.fleet import SimFleet
from tests.workloads.support import current_attempt, new_job

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow


async def test_following_a_log_written_mid_line_and_mid_character_loses_nothing(
    sim_fleet, db: Database
) -> None:
    """Given a running job whose train.log is written in pieces that end inside a line
    and inside a UTF-8 character, and that holds invalid UTF-8, `--follow` prints exactly
    the bytes written, once: nothing replaced, skipped or repeated; it ends when the job
    does."""
    fleet: SimFleet = await sim_fleet(1)
    vm_id = (await fleet.register(db))["vm0"]
    job_id = await new_job(db)
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status="running", vm_id=vm_id, attempt=1, launch_token=new_token())
        )
    log = fleet[0].home / (await current_attempt(db, job_id)).relative / "train.log"
    log.parent.mkdir(parents=True)
    pieces = [
        b"step 1 caf",
        "é".encode()[:1],
        "é ok\n".encode()[1:],
        b"bad \xff\xfe bytes\n",
        b"step 2\n",
    ]

    async def write_slowly() -> None:
        for piece in pieces:
            with log.open("ab") as f:
                f.write(piece)
            await asyncio.sleep(0.4)
        async with db.transaction() as session:
            await session.execute(update(Job).where(Job.id == job_id).values(status="completed"))

    out: list[bytes] = []
    transport = make_transport()
    try:
        writer = asyncio.create_task(write_slowly())
        await asyncio.wait_for(
            stream_log(db, transport, job_id, out.append, follow=True, poll_s=0.1), 30
        )
        await writer
    finally:
        await transport.close()
    assert b"".join(out) == b"".join(pieces)


async def test_a_log_larger_than_the_transport_cap_comes_back_whole(
    sim_fleet, db: Database
) -> None:
    """Given a train.log of 3.5 MB of random bytes (past the transport's default output
    cap, and sent as hex: 4 times as many characters), `job logs` writes every byte of it:
    the log reader asks the transport for the output it needs."""
    fleet: SimFleet = await sim_fleet(1)
    vm_id = (await fleet.register(db))["vm0"]
    job_id = await new_job(db)
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status="completed", vm_id=vm_id, attempt=1, launch_token=new_token())
        )
    log = fleet[0].home / (await current_attempt(db, job_id)).relative / "train.log"
    log.parent.mkdir(parents=True)
    data = os.urandom(3_500_000)
    log.write_bytes(data)
    out: list[bytes] = []
    transport = make_transport()
    try:
        await asyncio.wait_for(stream_log(db, transport, job_id, out.append), 60)
    finally:
        await transport.close()
    assert b"".join(out) == data
