"""`leftovers.abandon_attempt` against real Postgres: the one way a job leaves an attempt
behind moves the job, records the leftover and frees the GPUs, in that order."""

from __future__ import annotations

from sqlalchemy import func, select, text, update

from scheduler.claims.batch import claim_gpus
from scheduler.claims.leases import expire_leases
from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.leftovers import AttemptRecord, abandon_attempt, open_leftover_count
from scheduler.models import GPU, VM, Job, JobEvent, Leftover
from scheduler.states import FailureReason, JobStatus
from tests.workloads.support import add_vm_row, new_job


async def claimed(db: Database, vm_gpus: int, need: int) -> tuple[int, Claim]:
    """A VM with `vm_gpus` GPUs and a job `starting` on `need` of them."""
    vm_id = await add_vm_row(db, "a", vm_gpus)
    claim = await claim_gpus(db, await new_job(db, need), actor="test")
    assert isinstance(claim, Claim)
    return vm_id, claim


async def test_abandoning_counts_the_leftovers_gpus_out_at_once(db: Database) -> None:
    """Given a job starting on 2 of a VM's 4 GPUs, when its attempt is abandoned as a
    leftover (a failed launch), then the job is failed, its GPU rows are free, and the VM's
    recount, done by the release, already leaves the leftover's 2 GPUs out."""
    vm_id, claim = await claimed(db, 4, 2)
    async with db.transaction() as session:
        record = AttemptRecord(
            claim.job_id, claim.attempt, vm_id, claim.gpu_indices, claim.gpu_uuids, claim.token
        )
        moved = await abandon_attempt(
            session,
            record,
            expected=JobStatus.STARTING,
            to=JobStatus.FAILED,
            reason="launch failed: test",
            actor="test",
            leftover="launch_failed",
            failure_reason=FailureReason.LAUNCH_FAILED.value,
        )
    assert moved
    async with db.transaction() as session:
        job = await session.get(Job, claim.job_id)
        assert job is not None
        assert (job.status, job.failure_reason, job.status_reason, job.lease_expires_at) == (
            "failed",
            "launch_failed",
            "launch failed: test",
            None,
        )
        held = await session.scalar(select(func.count()).where(GPU.job_id.is_not(None)))
        assert held == 0
        leftover = (await session.scalars(select(Leftover))).one()
        assert (leftover.reason, leftover.gpu_uuids, leftover.launch_token) == (
            "launch_failed",
            list(claim.gpu_uuids),
            claim.token,
        )
        assert await open_leftover_count(session, vm_id) == 1
        assert await session.scalar(select(VM.available_gpus).where(VM.id == vm_id)) == 2


async def test_an_expired_lease_recounts_without_the_leftovers_gpus(db: Database) -> None:
    """Given a claim whose lease expired, when `expire_leases` takes it back, then the VM's
    count of available GPUs leaves out the GPUs the possibly started attempt may hold."""
    vm_id, claim = await claimed(db, 3, 1)
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == claim.job_id)
            .values(lease_expires_at=func.now() - text("interval '1 second'"))
        )
    assert await expire_leases(db) == [claim.job_id]
    async with db.transaction() as session:
        assert await session.scalar(select(VM.available_gpus).where(VM.id == vm_id)) == 2


async def test_an_attempt_that_moved_on_is_not_abandoned(db: Database) -> None:
    """Given a job whose attempt is no longer the one named, abandoning that attempt
    changes nothing: no event, no leftover, its GPUs stay with the job."""
    vm_id, claim = await claimed(db, 2, 1)
    async with db.transaction() as session:
        moved = await abandon_attempt(
            session,
            AttemptRecord(claim.job_id, claim.attempt + 1, vm_id, claim.gpu_indices),
            expected=JobStatus.STARTING,
            to=JobStatus.CANCELLED,
            reason="cancelled by the user",
            actor="test",
            leftover="cancelled",
        )
    assert not moved
    async with db.transaction() as session:
        assert await session.scalar(select(func.count()).select_from(Leftover)) == 0
        events = await session.scalar(
            select(func.count()).select_from(JobEvent).where(JobEvent.job_id == claim.job_id)
        )
        assert events == 2  # submitted, claimed
        held = await session.scalar(select(func.count()).where(GPU.job_id == claim.job_id))
        assert held == 1
