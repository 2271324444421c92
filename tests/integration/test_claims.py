"""GPU claims against real Postgres: best fit, never a GPU twice, pending with a reason,
and leases that expire."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from sqlalchemy import func, select, text, update

from scheduler.claims.batch import claim_batch, claim_gpus
from scheduler.claims.leases import expire_leases
from scheduler.claims.records import Launched, mark_running_batch
from scheduler.claims.result import Claim, NoClaim
from scheduler.db import Database
from scheduler.gpus import refresh_available, release_in_session
from scheduler.jobs import get_job
from scheduler.leftovers import close_leftover, record_leftover
from scheduler.models import GPU, VM, Job, Leftover
from scheduler.remote.layout import default_output_dir
from tests.workloads.support import add_vm_row, new_job


async def allocations(db: Database) -> dict[int, tuple[int, list[int]]]:
    """job id -> (vm id, GPU indices) as the gpus table says."""
    async with db.transaction() as session:
        rows = (await session.execute(select(GPU.job_id, GPU.vm_id, GPU.index))).all()
    out: dict[int, tuple[int, list[int]]] = {}
    for job_id, vm_id, index in sorted(rows, key=lambda r: r.index):
        if job_id is not None:
            out.setdefault(job_id, (vm_id, []))[1].append(index)
    return out


async def test_best_fit_keeps_big_holes_for_big_jobs(db: Database) -> None:
    """Given VMs with 8, 2 and 4 free GPUs, a 2-GPU job goes to the 2-GPU VM and a
    4-GPU job to the 4-GPU VM, so the 8-GPU VM stays whole."""
    big = await add_vm_row(db, "big", 8)
    small = await add_vm_row(db, "small", 2)
    mid = await add_vm_row(db, "mid", 4)
    two, four = await new_job(db, 2), await new_job(db, 4)

    c2 = await claim_gpus(db, two, actor="test")
    c4 = await claim_gpus(db, four, actor="test")
    await refresh_available(db, {big, small, mid})

    assert isinstance(c2, Claim) and (c2.vm_id, c2.gpu_indices) == (small, [0, 1])
    assert isinstance(c4, Claim) and (c4.vm_id, c4.gpu_indices) == (mid, [0, 1, 2, 3])
    async with db.transaction() as session:
        job = await get_job(session, four, with_events=True)
        available = dict((await session.execute(select(VM.id, VM.available_gpus))).all())
    assert job.status == "starting" and job.attempt == 1 and job.vm_id == mid
    assert job.gpu_indices == [0, 1, 2, 3]
    assert job.output_dir == default_output_dir(c4.installation, four)
    assert job.launch_token == c4.token and c4.attempt_ref.attempt == 1 and job.attempt_dir is None
    assert job.lease_expires_at is not None and job.lease_expires_at > job.starting_at
    assert [(e.from_status, e.to_status) for e in job.events][-1] == ("queued", "starting")
    assert available == {big: 8, small: 0, mid: 0}


async def test_nothing_fits_means_pending_with_the_reason(db: Database) -> None:
    """Given only 2 free GPUs on any VM (the 4-GPU one is unreachable), a 4-GPU job is
    pending and says why, naming the unreachable VM."""
    await add_vm_row(db, "a", 2)
    await add_vm_row(db, "big", 4, status="unreachable")
    job_id = await new_job(db, 4)
    result = await claim_gpus(db, job_id, actor="test")
    assert isinstance(result, NoClaim) and result.moved_to_pending
    async with db.transaction() as session:
        job = await get_job(session, job_id)
    assert job.status == "pending"
    assert job.status_reason == "needs 4 GPUs, largest free block is 2 (big: unreachable)"


async def test_unusable_gpus_and_vms_are_never_claimed(db: Database) -> None:
    """Unhealthy, foreign-busy, stale-process GPUs and draining or unreachable VMs are
    skipped; only the one clean GPU is claimed."""
    await add_vm_row(db, "draining", 1, draining=True)
    await add_vm_row(db, "down", 1)
    ok = await add_vm_row(db, "ok", 4)
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.name == "down").values(status="unreachable"))
        await session.execute(
            update(GPU).where(GPU.vm_id == ok, GPU.index == 0).values(healthy=False)
        )
        await session.execute(
            update(GPU).where(GPU.vm_id == ok, GPU.index == 1).values(foreign_busy=True)
        )
        leftover = await new_job(db, 1)
        session.add(Leftover(vm_id=ok, job_id=leftover, attempt=1, gpu_indices=[2], reason="t"))
    first, second = await new_job(db), await new_job(db)
    c1 = await claim_gpus(db, first, actor="test")
    c2 = await claim_gpus(db, second, actor="test")
    assert isinstance(c1, Claim) and (c1.vm_id, c1.gpu_indices) == (ok, [3])
    assert isinstance(c2, NoClaim) and c2.reason == (
        "needs 1 GPU, largest free block is 0 (ok: 1 GPU unhealthy, 1 GPU busy with a process "
        "rlfleet did not start, 1 GPU held by a leftover attempt; draining: draining; "
        "down: unreachable)"
    )


async def test_a_job_whose_earlier_attempt_may_still_run_is_not_claimed(db: Database) -> None:
    """Given a queued job whose attempt 1 may still run on a VM that answers (a failed
    launch, a lost VM come back), however its id arrives (a `job retry`, a user's own
    publish), the claim refuses it and asks to be tried again, until the kill has closed
    the leftover; a leftover on a VM that does not answer cannot be waited for."""
    old_vm = await add_vm_row(db, "old", 1)
    await add_vm_row(db, "new", 1)
    await add_vm_row(db, "spare", 1)
    job_id = await new_job(db)
    async with db.transaction() as session:
        await record_leftover(
            session, vm_id=old_vm, job_id=job_id, attempt=1, gpu_indices=[0], reason="t", token=None
        )
    refused = await claim_gpus(db, job_id, actor="test")
    assert isinstance(refused, NoClaim) and refused.waiting and not refused.contended
    assert (await get_job_status(db, job_id)) == "queued"

    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.id == old_vm).values(status="unreachable"))
    assert isinstance(await claim_gpus(db, job_id, actor="test"), Claim)

    # Once the leftover is killed, a job held back by it is claimed.
    other = await new_job(db)
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.id == old_vm).values(status="healthy"))
        await record_leftover(
            session, vm_id=old_vm, job_id=other, attempt=1, gpu_indices=None, reason="t", token=None
        )
    assert isinstance(await claim_gpus(db, other, actor="test"), NoClaim)
    async with db.transaction() as session:
        await close_leftover(session, vm_id=old_vm, job_id=other, attempt=1)
    assert isinstance(await claim_gpus(db, other, actor="test"), Claim)


async def get_job_status(db: Database, job_id: int) -> str:
    """The job's status now."""
    async with db.transaction() as session:
        return (await get_job(session, job_id)).status


async def test_a_job_not_queued_is_left_alone(db: Database) -> None:
    """A second delivery of a claimed job, and an unknown id, claim nothing."""
    await add_vm_row(db, "a", 2)
    job_id = await new_job(db)
    assert isinstance(await claim_gpus(db, job_id, actor="test"), Claim)
    again = await claim_gpus(db, job_id, actor="test")
    assert isinstance(again, NoClaim) and again.status == "starting"
    unknown = await claim_gpus(db, 10**9, actor="test")
    assert isinstance(unknown, NoClaim) and unknown.status is None
    assert list(await allocations(db)) == [job_id]


async def test_racing_claimers_never_share_a_gpu(db: Database) -> None:
    """Given 10 VMs with 48 GPUs in all and 80 jobs of 1-4 GPUs, each claimed by 4
    concurrent claimers at once (every job twice), then no GPU is held twice, no job is
    claimed twice, and jobs are only pending when their size really does not fit."""
    rng = random.Random(4)
    for i in range(10):
        await add_vm_row(db, f"vm{i}", rng.choice([2, 4, 8]))
    sizes = {await new_job(db, rng.randint(1, 4)): 0 for _ in range(80)}
    ids = list(sizes) * 2
    rng.shuffle(ids)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for job_id in ids:
        queue.put_nowait(job_id)
    claims: list[Claim] = []

    async def claimer() -> None:
        while not queue.empty():
            job_id = queue.get_nowait()
            result = await claim_gpus(db, job_id, actor="test")
            if isinstance(result, Claim):
                claims.append(result)
            elif result.contended:
                queue.put_nowait(job_id)

    await asyncio.gather(*(claimer() for _ in range(4)))

    assert Counter(c.job_id for c in claims).most_common(1)[0][1] == 1
    held = [(c.vm_id, i) for c in claims for i in c.gpu_indices]
    assert len(held) == len(set(held))
    table = await allocations(db)
    assert {j: (c.vm_id, c.gpu_indices) for c in claims for j in [c.job_id]} == table
    await refresh_available(db, set(range(1, 11)))
    async with db.transaction() as session:
        free = (
            await session.execute(
                text("SELECT vm_id, count(*) FROM gpus WHERE job_id IS NULL GROUP BY vm_id")
            )
        ).all()
        pending = (
            await session.execute(select(Job.gpus_requested).where(Job.status == "pending"))
        ).scalars()
        mismatched = await session.scalar(
            text(
                "SELECT count(*) FROM vms v WHERE v.available_gpus <> "
                "(SELECT count(*) FROM gpus g WHERE g.vm_id = v.id AND g.job_id IS NULL)"
            )
        )
    largest = max((n for _vm, n in free), default=0)
    assert claims, "some jobs must have fitted"
    assert all(need > largest for need in pending)
    assert mismatched == 0


async def test_an_expired_lease_frees_the_gpus_and_requeues(db: Database) -> None:
    """Given a dispatcher that claimed and died before launching, when its lease expires,
    then a query finds it, `expire_leases` frees the GPUs (blocked only until the possibly
    started attempt is known dead) and the job is queued again; a live lease is kept."""
    vm_id = await add_vm_row(db, "a", 2)
    dead, alive = await new_job(db), await new_job(db)
    assert isinstance(await claim_gpus(db, dead, actor="test", lease_s=60), Claim)
    assert isinstance(await claim_gpus(db, alive, actor="test", lease_s=60), Claim)
    async with db.transaction() as session:
        await session.execute(
            update(Job)
            .where(Job.id == dead)
            .values(lease_expires_at=func.now() - text("interval '1 second'"))
        )
        found = (
            await session.execute(
                select(Job.id).where(Job.status == "starting", Job.lease_expires_at < func.now())
            )
        ).scalars()
        assert list(found) == [dead]

    assert await expire_leases(db) == [dead]
    assert await expire_leases(db) == []

    async with db.transaction() as session:
        job = await get_job(session, dead)
        stale = (await session.execute(select(Leftover))).scalars().one()
        assert job.status == "queued" and job.lease_expires_at is None and job.attempt == 1
        assert (await get_job(session, alive)).status == "starting"
        assert (stale.vm_id, stale.job_id, stale.attempt, stale.gpu_indices) == (
            vm_id,
            dead,
            1,
            [0],
        )
    assert list(await allocations(db)) == [alive]


async def test_release_frees_and_counts(db: Database) -> None:
    """Releasing a job's GPUs frees its rows and gives them back to the VM's count."""
    vm_id = await add_vm_row(db, "a", 4)
    job_id = await new_job(db, 3)
    assert isinstance(await claim_gpus(db, job_id, actor="test"), Claim)
    async with db.transaction() as session:
        assert await release_in_session(session, job_id) == [0, 1, 2]
    async with db.transaction() as session:
        assert await session.scalar(select(VM.available_gpus).where(VM.id == vm_id)) == 4
    assert await allocations(db) == {}


async def test_a_batch_claims_what_fits_and_parks_the_rest_in_one_transaction(
    db: Database,
) -> None:
    """Given one VM with 3 free GPUs and a batch of a 2-GPU job, a 4-GPU job, a 1-GPU job,
    a repeat of the first and an unknown id, then the batch claims the 2- and 1-GPU jobs,
    the 4-GPU job is pending with its reason and event, and the rest is left alone."""
    vm_id = await add_vm_row(db, "a", 3)
    await add_vm_row(db, "big", 4, status="unreachable")  # the 4-GPU job could run there
    two, four, one = await new_job(db, 2), await new_job(db, 4), await new_job(db, 1)

    results = await claim_batch(db, [two, four, one, two, 10**9], actor="test")

    c2, p4, c1, again, unknown = results
    assert isinstance(c2, Claim) and (c2.vm_id, c2.gpu_indices) == (vm_id, [0, 1])
    assert isinstance(c1, Claim) and (c1.vm_id, c1.gpu_indices) == (vm_id, [2])
    assert isinstance(p4, NoClaim) and p4.moved_to_pending
    # In order: the 2-GPU claim before it already left only one GPU free.
    assert p4.reason == "needs 4 GPUs, largest free block is 1 (big: unreachable)"
    assert isinstance(again, NoClaim) and not again.contended and not again.moved_to_pending
    assert isinstance(unknown, NoClaim) and unknown.status is None and not unknown.contended
    assert await allocations(db) == {two: (vm_id, [0, 1]), one: (vm_id, [2])}
    async with db.transaction() as session:
        job = await get_job(session, four, with_events=True)
    assert job.status == "pending" and job.status_reason == p4.reason
    assert [(e.from_status, e.to_status) for e in job.events][-1] == ("queued", "pending")


async def test_running_batch_moves_only_the_attempts_still_starting(db: Database) -> None:
    """Given two claimed jobs of which one is cancelled during its launch, recording both
    launches moves only the other one to running, with its pid and event row."""
    await add_vm_row(db, "a", 2)
    kept, cancelled = await new_job(db), await new_job(db)
    claims = await claim_batch(db, [kept, cancelled], actor="test")
    assert all(isinstance(c, Claim) for c in claims)
    async with db.transaction() as session:
        await session.execute(update(Job).where(Job.id == cancelled).values(status="cancelled"))

    async with db.engine.begin() as conn:
        moved = await mark_running_batch(
            conn,
            [Launched(kept, 1, 4242, "pid 4242"), Launched(cancelled, 1, 4343, "pid 4343")],
            actor="test",
        )

    assert list(moved) == [kept] and moved[kept].attempt == 1
    async with db.transaction() as session:
        job = await get_job(session, kept, with_events=True)
        assert (await get_job(session, cancelled)).status == "cancelled"
    assert (job.status, job.remote_pid, job.lease_expires_at) == ("running", 4242, None)
    assert [(e.from_status, e.to_status, e.reason) for e in job.events][-1] == (
        "starting",
        "running",
        "pid 4242",
    )


async def test_concurrent_batch_claimers_never_share_a_gpu(db: Database) -> None:
    """Given 6 VMs with 24 GPUs in all and 40 jobs of 1-3 GPUs, when two claimers each
    take the whole list in batches of 8 at the same time (every job twice), retrying what
    was contended, then no GPU is held twice and no job is claimed twice."""
    rng = random.Random(7)
    for i in range(6):
        await add_vm_row(db, f"vm{i}", 4)
    job_ids = [await new_job(db, rng.randint(1, 3)) for _ in range(40)]
    claims: list[Claim] = []

    async def claimer(order: list[int]) -> None:
        todo = order
        while todo:
            batch, todo = todo[:8], todo[8:]
            for result in await claim_batch(db, batch, actor="test"):
                if isinstance(result, Claim):
                    claims.append(result)
                elif result.contended:
                    todo.append(result.job_id)

    await asyncio.gather(claimer(list(job_ids)), claimer(list(reversed(job_ids))))

    assert claims and Counter(c.job_id for c in claims).most_common(1)[0][1] == 1
    held = [(c.vm_id, i) for c in claims for i in c.gpu_indices]
    assert len(held) == len(set(held)) == 24 - await free_gpus(db)
    assert {c.job_id: (c.vm_id, c.gpu_indices) for c in claims} == await allocations(db)


async def free_gpus(db: Database) -> int:
    """How many GPU rows no job holds."""
    async with db.transaction() as session:
        return await session.scalar(select(func.count()).where(GPU.job_id.is_(None))) or 0
