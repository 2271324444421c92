"""`vm set --job-user` (scheduler.fleet.set_job_user) against real Postgres: the job user
of a VM where a job runs is not changed (a kill signals the attempt's processes as the
VM's job user at the time: changing it under a running attempt would leave some of them
out of reach)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from scheduler import fleet
from scheduler.db import Database
from scheduler.errors import BadInput
from scheduler.jobs import JobSpec, insert_job, transition
from scheduler.models import VM
from scheduler.remote.layout import new_token
from scheduler.states import JobStatus
from tests.workloads.support import add_vm_row, place_rank0


async def test_the_job_user_of_a_vm_running_a_job_is_not_changed(db: Database) -> None:
    # Given a VM with a job user and a job starting there
    vm_id = await add_vm_row(db, "g3", 1, job_user="rljob")
    async with db.transaction() as session:
        job = await insert_job(session, JobSpec("m", "d", ("format",)), actor="test")
        await transition(
            session,
            job.id,
            expected=JobStatus.QUEUED,
            to=JobStatus.STARTING,
            reason="claimed",
            actor="test",
            values={"vm_id": vm_id, "attempt": 1, "gpu_indices": [0], "launch_token": new_token()},
        )
        await place_rank0(session, job.id)
    # Then neither clearing nor changing its job user is allowed
    for new in (None, "other"):
        with pytest.raises(BadInput, match="drain it"):
            async with db.transaction() as session:
                await fleet.set_job_user(session, "g3", new)
    async with db.transaction() as session:
        assert await session.scalar(select(VM.job_user).where(VM.id == vm_id)) == "rljob"
        # And setting the same value again changes nothing, so it passes
        await fleet.set_job_user(session, "g3", "rljob")
