"""`gpu_poller.finish.finish_rank` against real Postgres: the one way the poller finishes a rank
of any attempt, a single-node job's rank 0 like a multi-node job's rank 1."""

from __future__ import annotations

from sqlalchemy import select

from scheduler.claims.batch import claim_gpus
from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.gpu_poller.finish import finish_rank
from scheduler.jobspec import GroupSpec, Role
from scheduler.models import GPU, Job, JobNode, Leftover
from scheduler.states import FailureReason, JobStatus
from scheduler.verdicts import JobVerdict, LiveJob
from tests.workloads.support import add_vm_row, new_job


async def claim(db: Database, nodes: int) -> Claim:
    """A job of `nodes` one-GPU nodes, `starting` on as many VMs."""
    for name in "ab"[:nodes]:
        await add_vm_row(db, name, 1)
    claimed = await claim_gpus(db, await new_job(db, 1, nodes=nodes), actor="test")
    assert isinstance(claimed, Claim)
    return claimed


def verdict(claimed: Claim, rank: int, nodes: int, to: JobStatus, code: int) -> JobVerdict:
    vm_id = claimed.nodes[rank].vm_id if claimed.nodes else claimed.vm_id
    live = LiveJob(claimed.job_id, vm_id, "starting", claimed.attempt, 42, rank=rank, nodes=nodes)
    failure = FailureReason.EXIT_NONZERO if code else None
    return JobVerdict(live, to, code, failure, f"exit {code}")


async def state(db: Database, job_id: int) -> tuple[Job, list[tuple[int, int | None]], list[int]]:
    """The job row, its ranks' (rank, exit code) and the ranks recorded as leftovers."""
    async with db.transaction() as session:
        job = await session.get(Job, job_id)
        assert job is not None
        ranks = await session.execute(
            select(JobNode.rank, JobNode.exit_code)
            .where(JobNode.job_id == job_id)
            .order_by(JobNode.rank)
        )
        leftovers = await session.scalars(select(Leftover.rank).order_by(Leftover.rank))
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
        assert held is None  # the job's GPUs are freed whenever it moves
        return job, [tuple(r) for r in ranks.all()], [r for r in leftovers.all() if r is not None]


async def test_a_single_node_job_s_rank_0_completes_it_on_its_row(db: Database) -> None:
    claimed = await claim(db, 1)
    async with db.transaction() as session:
        moved = await finish_rank(session, verdict(claimed, 0, 1, JobStatus.COMPLETED, 0), "a")
    job, ranks, leftovers = await state(db, claimed.job_id)
    assert moved and (job.status, job.exit_code, job.completed_attempt) == ("completed", 0, 1)
    assert (ranks, leftovers) == ([(0, 0)], [])


async def test_a_single_node_job_s_failed_rank_0_leaves_no_leftover(db: Database) -> None:
    claimed = await claim(db, 1)
    async with db.transaction() as session:
        moved = await finish_rank(session, verdict(claimed, 0, 1, JobStatus.FAILED, 3), "a")
    job, ranks, leftovers = await state(db, claimed.job_id)
    assert moved and (job.status, job.exit_code, job.status_reason) == ("failed", 3, "exit 3")
    assert (ranks, leftovers) == ([(0, 3)], [])


async def test_a_failed_rank_fails_the_attempt_and_only_the_others_are_leftovers(
    db: Database,
) -> None:
    """Rank 1 of a two-node job failed: the job fails (the reason names the rank), rank 1's
    row keeps its exit code and is not a leftover (it has ended), rank 0 is one to kill."""
    claimed = await claim(db, 2)
    async with db.transaction() as session:
        moved = await finish_rank(session, verdict(claimed, 1, 2, JobStatus.FAILED, 3), "b")
    job, ranks, leftovers = await state(db, claimed.job_id)
    assert moved and (job.status, job.status_reason) == ("failed", "rank 1 on b: exit 3")
    assert (ranks, leftovers) == ([(0, None), (1, 3)], [0])


async def test_a_service_rank_that_exits_0_while_the_primary_runs_fails_the_group(
    db: Database,
) -> None:
    """A group whose reward service runs on a VM of its own (rank 1, not primary): when
    that rank exits 0 while the trainer (rank 0) still runs, the group fails, as its
    supervisor fails a service role that exits 0 early on one VM (the one rule,
    `attempts.end`); rank 0 is the leftover to kill."""
    spec = GroupSpec(
        roles=(
            Role("trainer", gpus=1, command=("true",), primary=True),
            Role("reward", gpus=1, command=("true",), own_vm=True),
        )
    )
    await add_vm_row(db, "a", 1)
    await add_vm_row(db, "b", 1)
    job_id = await new_job(db, 2, nodes=2, roles=spec.to_data())
    claimed = await claim_gpus(db, job_id, actor="test")
    assert isinstance(claimed, Claim)
    async with db.transaction() as session:
        moved = await finish_rank(session, verdict(claimed, 1, 2, JobStatus.COMPLETED, 0), "b")
    job, ranks, leftovers = await state(db, claimed.job_id)
    assert moved and (job.status, job.failure_reason) == ("failed", "exit_nonzero")
    assert (
        job.status_reason is not None
        and "runs services only and ended while a primary ran" in job.status_reason
    )
    assert (ranks, leftovers) == ([(0, None), (1, 0)], [0])
