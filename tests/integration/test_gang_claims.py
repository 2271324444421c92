"""Gang claims of multi-node jobs against real Postgres: all K × N GPUs or none, never a
GPU twice with single-node claimers racing, pending with a reason that says what is
missing, and every rank a leftover when the attempt is abandoned."""

from __future__ import annotations

import asyncio
import random

from sqlalchemy import select, text

from scheduler.attempts.shape import JobShape
from scheduler.claims.batch import CLAIM_COLUMNS, claim_gpus
from scheduler.claims.claim import claim
from scheduler.claims.result import Claim, NoClaim
from scheduler.db import Database
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL
from scheduler.jobs import get_job
from scheduler.jobspec import GroupSpec, Role
from scheduler.leftovers import AttemptRecord, abandon_attempt
from scheduler.models import GPU, Job, JobNode, Leftover
from scheduler.states import JobStatus
from tests.workloads.support import add_vm_row, new_job


async def test_a_gang_takes_k_distinct_vms_fullest_first(db: Database) -> None:
    """Given VMs with 8, 2, 4 and 2 GPUs, a 2 × 2 job takes both 2-GPU VMs (the fullest
    that fit), records every rank, and its row names rank 0."""
    await add_vm_row(db, "big", 8)
    a = await add_vm_row(db, "a", 2)
    await add_vm_row(db, "mid", 4)
    b = await add_vm_row(db, "b", 2)
    job_id = await new_job(db, 2, nodes=2)
    claim = await claim_gpus(db, job_id, actor="test")
    assert isinstance(claim, Claim)
    assert sorted(n.vm_id for n in claim.nodes) == sorted([a, b])
    assert [n.rank for n in claim.nodes] == [0, 1]
    assert claim.vm_id == claim.nodes[0].vm_id and claim.gpu_indices == [0, 1]
    async with db.transaction() as session:
        job = await get_job(session, job_id)
        ranks = (await session.execute(select(JobNode).order_by(JobNode.rank))).scalars().all()
        held = (await session.execute(select(GPU.vm_id).where(GPU.job_id == job_id))).all()
    assert job.status == "starting" and job.vm_id == claim.vm_id and job.attempt == 1
    assert [(r.rank, r.vm_id, r.attempt) for r in ranks] == [
        (0, claim.nodes[0].vm_id, 1),
        (1, claim.nodes[1].vm_id, 1),
    ]
    assert sorted(v for (v,) in held) == sorted([a, a, b, b])


async def test_a_gang_that_does_not_fit_takes_nothing_and_says_what_is_missing(
    db: Database,
) -> None:
    """One VM with 4 free GPUs and one with 2: a 2 × 4 job takes no GPU at all and waits
    "needs 2 VMs with 4 free GPUs; 1 has them", naming the unreachable VM that would have
    them; a 3 × 4 job on a fleet of two 4-GPU VMs
    says it can never run."""
    await add_vm_row(db, "a", 4)
    await add_vm_row(db, "b", 2)
    await add_vm_row(db, "c", 4, status="unreachable")
    job_id = await new_job(db, 4, nodes=2)
    result = await claim_gpus(db, job_id, actor="test")
    assert isinstance(result, NoClaim) and result.moved_to_pending
    assert result.reason == "needs 2 VMs with 4 free GPUs; 1 has them (c: unreachable)"
    never = await new_job(db, 4, nodes=3)
    result = await claim_gpus(db, never, actor="test")
    assert isinstance(result, NoClaim)
    assert result.reason == "needs 3 VMs with 4 GPUs each; only 2 VM(s) have that many"
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
        nodes = await session.scalar(select(JobNode.job_id).limit(1))
    assert held is None and nodes is None


async def _claim_per_node(db: Database, job_id: int, demands: list[int]) -> Claim | NoClaim:
    """The claim of a job whose shape has one GPU count per node (`demands`), in a
    transaction of its own, on the job's row locked as `claim_batch_in_session` locks it."""
    async with db.engine.begin() as conn:
        row = (
            await conn.execute(select(*CLAIM_COLUMNS).where(Job.id == job_id).with_for_update())
        ).one()
        shape = JobShape.of_row(row)
        assert list(shape.demands) == demands
        return await claim(conn, row, shape, actor="test", lease_s=60.0)


async def test_a_gang_of_unequal_nodes_takes_each_its_own_count_on_distinct_vms(
    db: Database,
) -> None:
    """A group of a 2-node trainer (2 GPUs each) and a 1-GPU server needs 3 GPUs on node 0
    and 2 on node 1: on VMs with 8, 3, 1 and 2 free it takes the 3 and the 2 (the fullest
    that fit), each rank its own count, and the audits count it whole. A second such group
    then takes nothing and waits, saying which size too few VMs have."""
    await add_vm_row(db, "big", 8)
    a = await add_vm_row(db, "a", 3)
    await add_vm_row(db, "b", 1)
    c = await add_vm_row(db, "c", 2)
    spec = GroupSpec(
        roles=(
            Role("trainer", gpus=2, nodes=2, primary=True, command=("train",)),
            Role("server", gpus=1, depends_on=(), command=("serve",)),
        )
    )
    demands = [n.gpus for n in spec.layout()]
    assert demands == [3, 2]
    first = await new_job(db, sum(demands), nodes=2, roles=spec.to_data())
    claim = await _claim_per_node(db, first, demands)
    assert isinstance(claim, Claim)
    assert [(n.rank, n.vm_id, len(n.gpu_uuids)) for n in claim.nodes] == [(0, a, 3), (1, c, 2)]
    async with db.transaction() as session:
        partial = await session.scalar(PARTIAL_CLAIMS_SQL)
        double = await session.scalar(DOUBLE_BOOKED_SQL)
        reason = await session.scalar(
            text("SELECT reason FROM job_events WHERE job_id = :j AND to_status = 'starting'"),
            {"j": first},
        )
    assert partial == 0 and double == 0
    assert reason == f"claimed 3+2 GPUs on VMs {a},{c}"
    second = await new_job(db, sum(demands), nodes=2, roles=spec.to_data())
    result = await _claim_per_node(db, second, demands)
    assert isinstance(result, NoClaim) and result.moved_to_pending
    assert result.reason == "needs 2 VMs with 3 and 2 free GPUs; 1 VM(s) have 2 free, 2 needed"
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id == second).limit(1))
    assert held is None


async def test_racing_gang_and_single_claimers_never_share_a_gpu_nor_claim_half(
    db: Database,
) -> None:
    """Given 12 VMs of 2-8 GPUs and 90 jobs of 1, 2 and 4 nodes × 1-4 GPUs, each delivered
    twice to 6 concurrent claimers: no GPU is held twice, no job holds part of its GPUs,
    every gang's ranks are on distinct VMs, and a gang is pending only when too few VMs
    had room at the end."""
    rng = random.Random(11)
    for i in range(12):
        await add_vm_row(db, f"vm{i}", rng.choice([2, 4, 8]))
    jobs = [await new_job(db, rng.randint(1, 4), nodes=rng.choice([1, 1, 2, 4])) for _ in range(90)]
    ids = jobs * 2
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

    await asyncio.gather(*(claimer() for _ in range(6)))

    assert len({c.job_id for c in claims}) == len(claims)
    assert any(c.nodes for c in claims) and any(not c.nodes for c in claims)
    async with db.transaction() as session:
        partial = await session.scalar(PARTIAL_CLAIMS_SQL)
        double = await session.scalar(DOUBLE_BOOKED_SQL)
        held = (await session.execute(select(GPU.id, GPU.job_id))).all()
        gangs = {
            row.job_id: row
            for row in (
                await session.execute(select(JobNode.job_id, JobNode.vm_id, JobNode.gpu_uuids))
            ).all()
        }
        free = dict(
            (
                await session.execute(
                    text("SELECT vm_id, count(*) FROM gpus WHERE job_id IS NULL GROUP BY vm_id")
                )
            ).all()
        )
        pending = (
            await session.execute(
                select(Job.gpus_requested, Job.nodes).where(Job.status == "pending")
            )
        ).all()
    assert partial == 0 and double == 0
    claimed_uuids = [
        u for c in claims for u in ([u for n in c.nodes for u in n.gpu_uuids] or c.gpu_uuids)
    ]
    assert len(claimed_uuids) == len(set(claimed_uuids))
    assert sum(1 for _gpu, job in held if job is not None) == len(claimed_uuids)
    for c in claims:
        if c.nodes:
            assert len({n.vm_id for n in c.nodes}) == len(c.nodes)
    assert gangs  # rows were written for the gangs
    for total, nodes in pending:  # every GPU of the attempt, the same on each VM
        assert sum(1 for n in free.values() if n >= total // nodes) < nodes


async def test_abandoning_a_gang_makes_every_rank_a_leftover(db: Database) -> None:
    """A 3 × 1 job given up (as a lost node or a cancel does) records a leftover on each of
    its three VMs and frees its GPU rows, which stay blocked until the kills succeed."""
    for name in ("a", "b", "c"):
        await add_vm_row(db, name, 1)
    job_id = await new_job(db, 1, nodes=3)
    claim = await claim_gpus(db, job_id, actor="test")
    assert isinstance(claim, Claim) and len(claim.nodes) == 3
    async with db.transaction() as session:
        row = (
            await session.execute(select(*AttemptRecord.columns()).where(Job.id == job_id))
        ).one()
        moved = await abandon_attempt(
            session,
            AttemptRecord.from_row(row),
            expected=JobStatus.STARTING,
            to=JobStatus.FAILED,
            reason="node_lost: test",
            actor="test",
            leftover="node_lost",
            failure_reason="node_lost",
        )
    assert moved
    async with db.transaction() as session:
        left = (await session.execute(select(Leftover.vm_id, Leftover.gpu_uuids))).all()
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
    assert sorted(v for v, _u in left) == sorted(n.vm_id for n in claim.nodes)
    assert sorted(u[0] for _v, u in left) == sorted(n.gpu_uuids[0] for n in claim.nodes)
    assert held is None
    again = await new_job(db, 1)
    result = await claim_gpus(db, again, actor="test")
    assert isinstance(result, NoClaim)  # every GPU still blocked by a leftover
