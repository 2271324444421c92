"""One claim path for every kind of job, against real Postgres: a single-node job, a group
on one VM, a multi-node job and a group over several VMs are claimed alike (one statement
each after the batch's lock), every rank recorded by the claim, ties between equally full
VMs broken as `placement` orders them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event, select, text, update

from scheduler.claims.batch import claim_batch, claim_gpus
from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL
from scheduler.jobspec import GroupSpec, Role
from scheduler.models import GPU, Job, JobNode
from scheduler.placement import vm_order
from tests.workloads.support import add_vm_row, new_job


@contextmanager
def statements(db: Database) -> Iterator[list[str]]:
    """The SQL statements the database's engine sends while in the block."""
    sent: list[str] = []

    def note(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        sent.append(statement)

    engine = db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", note)


def group(trainer_nodes: int) -> GroupSpec:
    """A trainer of 2 GPUs per node over `trainer_nodes` VMs and a 1-GPU server beside
    its rank 0."""
    return GroupSpec(
        roles=(
            Role("trainer", gpus=2, nodes=trainer_nodes, primary=True, command=("train",)),
            Role("server", gpus=1, depends_on=(), command=("serve",)),
        )
    )


async def test_every_kind_of_job_is_claimed_by_one_statement_after_the_batch_lock(
    db: Database,
) -> None:
    """Given room for all, one batch of a 2-GPU job, a group on one VM (3 GPUs), a 2 × 2
    job and a group over two VMs (3 + 2 GPUs) claims each in ONE statement after the
    batch's three (job rows, free count, shortlist lock), and the claim writes every
    rank's `job_nodes` row with exactly the GPUs it holds."""
    for i in range(8):
        await add_vm_row(db, f"vm{i}", 4)
    single = await new_job(db, 2)
    one_vm = await new_job(db, 3, roles=group(1).to_data())
    gang = await new_job(db, 2, nodes=2)
    spread = await new_job(db, 5, nodes=2, roles=group(2).to_data())
    ids = [single, one_vm, gang, spread]
    with statements(db) as sent:
        results = await claim_batch(db, ids, actor="test")
    assert all(isinstance(r, Claim) for r in results), results
    assert len(sent) <= 3 + len(ids), "\n\n".join(sent)
    claims = {r.job_id: r for r in results if isinstance(r, Claim)}
    async with db.transaction() as session:
        ranks = (await session.execute(select(JobNode).order_by(JobNode.job_id))).scalars().all()
        held = (await session.execute(select(GPU.job_id, GPU.vm_id, GPU.index))).all()
        audits = (await session.scalar(PARTIAL_CLAIMS_SQL), await session.scalar(DOUBLE_BOOKED_SQL))
    assert audits == (0, 0)
    recorded = {(n.job_id, n.rank): (n.vm_id, sorted(n.gpu_indices)) for n in ranks}
    expected = {}
    for job_id, c in claims.items():
        for n in c.nodes or ():
            expected[(job_id, n.rank)] = (n.vm_id, sorted(n.gpu_indices))
        if not c.nodes:
            expected[(job_id, 0)] = (c.vm_id, sorted(c.gpu_indices))
    assert recorded == expected
    holding: dict[tuple[int, int], list[int]] = {}
    for job_id, vm_id, index in held:
        if job_id is not None:
            holding.setdefault((job_id, vm_id), []).append(index)
    assert {k: sorted(v) for k, v in holding.items()} == {
        (job_id, vm): gpus for (job_id, _rank), (vm, gpus) in expected.items()
    }
    assert [len(expected[(job, 0)][1]) for job in ids] == [2, 3, 2, 3]
    assert len(expected[(spread, 1)][1]) == 2 and not claims[one_vm].nodes


async def test_ties_between_equally_full_vms_are_broken_as_placement_orders_them(
    db: Database,
) -> None:
    """Given six equally full 4-GPU VMs, each 4-GPU job claimed in turn takes the first
    VM of `placement.vm_order` for it among those still free: the claim's SQL and the
    pure placement break ties alike."""
    vms = [await add_vm_row(db, f"vm{i}", 4) for i in range(6)]
    free = dict.fromkeys(vms, 4)
    for _ in range(5):
        job_id = await new_job(db, 4)
        expected = vm_order(free, 4, job_id)[0]
        claim = await claim_gpus(db, job_id, actor="test")
        assert isinstance(claim, Claim) and claim.vm_id == expected
        free[expected] = 0


async def test_a_new_attempt_replaces_every_rank_row_of_the_last(db: Database) -> None:
    """A job claimed again after its attempt was given up has its rank rows written anew
    by the claim: nothing of the last attempt's rank 0 (pid, directory, exit code, role
    restarts) is kept, and a rank the new attempt does not have is gone."""
    await add_vm_row(db, "a", 2)
    job_id = await new_job(db, 2)
    first = await claim_gpus(db, job_id, actor="test")
    assert isinstance(first, Claim)
    async with db.transaction() as session:
        await session.execute(
            update(JobNode)
            .where(JobNode.job_id == job_id)
            .values(
                remote_pid=42,
                attempt_dir="/tmp/a",
                exit_code=1,
                role_restarts={"attempt": 1, "roles": {"train": 2}},
            )
        )
        session.add(
            JobNode(
                job_id=job_id,
                rank=1,
                attempt=1,
                vm_id=first.vm_id,
                gpu_indices=[9],
                gpu_uuids=["GPU-x"],
            )  # fmt: skip
        )
        await session.execute(text("UPDATE gpus SET job_id = NULL"))
        await session.execute(update(Job).where(Job.id == job_id).values(status="queued"))
    second = await claim_gpus(db, job_id, actor="test")
    assert isinstance(second, Claim) and second.attempt == 2
    async with db.transaction() as session:
        rows = (await session.execute(select(JobNode).where(JobNode.job_id == job_id))).scalars()
        got = [
            (r.rank, r.attempt, r.remote_pid, r.attempt_dir, r.exit_code, r.role_restarts)
            for r in rows
        ]
    assert got == [(0, 2, None, None, None, {})]
