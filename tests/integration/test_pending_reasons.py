"""Pending reasons that say why (`scheduler.claims.why`), against real Postgres: a job that
fits nowhere waits with the cause named when GPUs that would let it run exist but are kept
out of use — unhealthy, drained, busy with a foreign process, held by a leftover, on a
draining or unreachable VM — and a gang says which VMs it lacks and why; a VM's name and a
GPU's health text, which come from rows, reach the reason as one sanitized line."""

from __future__ import annotations

from sqlalchemy import update

from scheduler.claims.batch import claim_gpus
from scheduler.claims.result import NoClaim
from scheduler.db import Database
from scheduler.models import GPU, VM, Leftover
from tests.workloads.support import add_vm_row, job_row, new_job


async def gpus_of(db: Database, vm_id: int, indices: list[int], **values: object) -> None:
    """Set `values` on these GPUs of the VM."""
    async with db.transaction() as session:
        await session.execute(
            update(GPU).where(GPU.vm_id == vm_id, GPU.index.in_(indices)).values(**values)
        )


async def parked(db: Database, gpus: int, nodes: int = 1) -> str:
    """Submit a job, claim it, and return the reason it now waits with."""
    job_id = await new_job(db, gpus, nodes=nodes)
    result = await claim_gpus(db, job_id, actor="test")
    assert isinstance(result, NoClaim) and result.moved_to_pending, result
    row = await job_row(db, job_id)
    assert row.status == "pending" and row.status_reason == result.reason
    assert result.reason is not None
    return result.reason


async def test_unhealthy_gpus_are_named_with_their_health_reason(db: Database) -> None:
    """A 4-GPU VM with 2 GPUs unhealthy (an XID): a 4-GPU job says so, not only that the
    largest free block is 2."""
    a = await add_vm_row(db, "vm-a", 4)
    await gpus_of(db, a, [1, 3], healthy=False, health_reason="Xid 79: fallen off the bus")
    assert await parked(db, 4) == (
        "needs 4 GPUs, largest free block is 2 (vm-a: 2 GPUs unhealthy: Xid 79: fallen off the bus)"
    )


async def test_drained_gpus_and_draining_vms_are_named(db: Database) -> None:
    """One VM with a GPU drained by hand, one draining, one whose GPUs are all held (not
    named: nothing but jobs keeps them): the reason names the first two, by name."""
    a = await add_vm_row(db, "vm-a", 4)
    await add_vm_row(db, "vm-b", 4, draining=True)
    c = await add_vm_row(db, "vm-c", 4)
    await gpus_of(db, a, [0], drained=True)
    holder = await new_job(db, 4)
    await gpus_of(db, c, [0, 1, 2, 3], job_id=holder)
    assert await parked(db, 4) == (
        "needs 4 GPUs, largest free block is 3 (vm-a: 1 GPU drained; vm-b: draining)"
    )


async def test_unreachable_vms_foreign_processes_and_leftovers_are_named(db: Database) -> None:
    """An unreachable VM, a GPU busy with a process rlfleet did not start, and GPUs an
    earlier attempt may still hold (a leftover) are each a cause."""
    await add_vm_row(db, "vm-a", 2, status="unreachable")
    b = await add_vm_row(db, "vm-b", 2)
    c = await add_vm_row(db, "vm-c", 2)
    await gpus_of(db, b, [1], foreign_busy=True)
    old = await new_job(db, 1)
    async with db.transaction() as session:
        session.add(Leftover(vm_id=c, job_id=old, attempt=1, gpu_uuids=["GPU-vm-c-0"], reason="t"))
    assert await parked(db, 2) == (
        "needs 2 GPUs, largest free block is 1 (vm-a: unreachable; "
        "vm-b: 1 GPU busy with a process rlfleet did not start; "
        "vm-c: 1 GPU held by a leftover attempt)"
    )


async def test_a_gang_says_which_vms_it_lacks_and_why(db: Database) -> None:
    """Two 4-GPU VMs, one with a drained GPU: a 2 × 4 job needs 2 VMs with 4 free GPUs and
    1 has them, because of the drained GPU."""
    await add_vm_row(db, "vm-a", 4)
    c = await add_vm_row(db, "vm-c", 4)
    await gpus_of(db, c, [2], drained=True)
    assert await parked(db, 4, nodes=2) == (
        "needs 2 VMs with 4 free GPUs; 1 has them (vm-c: 1 GPU drained)"
    )


async def test_a_job_no_vm_could_ever_run_names_no_vm(db: Database) -> None:
    """The fleet's size is the cause: no VM is named even though one is draining."""
    await add_vm_row(db, "vm-a", 2, draining=True)
    assert await parked(db, 4) == "no VM has 4 GPUs (the largest has 2)"


async def test_names_and_health_text_from_rows_reach_the_reason_as_one_clean_line(
    db: Database,
) -> None:
    """A VM name and a health reason with control characters and newlines (rows written
    by hand) give a one-line reason of printable characters, at most 500 long."""
    a = await add_vm_row(db, "vm-a", 2)
    async with db.transaction() as session:
        await session.execute(update(VM).where(VM.id == a).values(name="evil\x1b[31m\nname"))
    await gpus_of(db, a, [0], healthy=False, health_reason="bad\r\nline\x07" + "x" * 900)
    reason = await parked(db, 2)
    assert reason.isprintable() and len(reason) <= 500
    assert reason.startswith("needs 2 GPUs, largest free block is 1 (evil [31m name: 1 GPU ")
    assert "\x1b" not in reason and "\n" not in reason
