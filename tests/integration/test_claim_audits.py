"""The claim audits (`gpus.PARTIAL_CLAIMS_SQL`) hold for every kind of job alike: one VM
per rank, and each live rank holding exactly the GPUs its `job_nodes` row names on its
VM, for a job of one VM as for a gang (issue 30: no branch on the kind of job)."""

from __future__ import annotations

from sqlalchemy import text

from scheduler.claims.batch import claim_gpus
from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.gpus import PARTIAL_CLAIMS_SQL
from tests.workloads.support import add_vm_row, new_job


async def _partial(db: Database) -> int:
    async with db.transaction() as session:
        return int(await session.scalar(PARTIAL_CLAIMS_SQL) or 0)


async def test_a_one_vm_job_whose_rank_holds_other_gpus_than_its_row_names_is_counted(
    db: Database,
) -> None:
    # Given a job of one VM claimed as usual (its rank 0 row names its 2 GPUs)
    vms = {await add_vm_row(db, "a", 4), await add_vm_row(db, "b", 4)}
    job_id = await new_job(db, 2)
    claim = await claim_gpus(db, job_id, actor="test")
    assert isinstance(claim, Claim)
    (other,) = vms - {claim.vm_id}
    assert await _partial(db) == 0
    # When one of its GPUs is swapped for one on another VM (a broken claim)
    async with db.transaction() as session:
        await session.execute(
            text(
                "UPDATE gpus SET job_id = NULL WHERE job_id = :job AND index = "
                "(SELECT max(index) FROM gpus WHERE job_id = :job)"
            ),
            {"job": job_id},
        )
        await session.execute(
            text("UPDATE gpus SET job_id = :job WHERE vm_id = :vm AND index = 0"),
            {"job": job_id, "vm": other},
        )
    # Then the audit counts it: two VMs for one rank, and a rank short of its GPUs there
    assert await _partial(db) == 1
