"""Attempts on a GPU that cannot compute any more: a GPU lost from nvidia-smi's listing or
one that reports a fault (`[GPU requires reset]`, `[Unknown Error]`, `ERR!`;
`scheduler.gpu_health`). The attempt there is stopped the way a fenced one is: its job
fails with `gpu_failed`, a machine fault (retried at once, elsewhere, no retry used), and
every rank of the attempt becomes a leftover that the requeue manager's kill sweep stops
(TERM, the grace, KILL) before the job runs again (`attempts.end`, carried out by
`attempts.finish.end_attempt`).

An attempt on a GPU whose ECC count rose, or that waits for a page retirement or row
remapping, is left alone: the GPU only takes no new job (docs/gpu-health.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select

from scheduler import metrics
from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.db import Database
from scheduler.gpu_poller.state import Outcome
from scheduler.logging import get_logger
from scheduler.models import Job
from scheduler.states import LIVE_STATES, FailureReason, JobStatus

log = get_logger("gpu_poller")

GPU_FAILED = FailureReason.GPU_FAILED.value


@dataclass(frozen=True)
class BrokenGpu:
    """A GPU a live attempt holds that cannot compute: the attempt is to be stopped."""

    job_id: int
    attempt: int
    vm_name: str
    gpu_index: int
    uuid: str
    reason: str


def broken_gpus(outcome: Outcome) -> list[BrokenGpu]:
    """The GPUs of live attempts on this polled VM that are lost or report a fault, one
    per job (pure), as the poll's one judgement of each GPU's health said
    (`Outcome.health`). A VM whose nvidia-smi failed as a whole is not judged per GPU."""
    result = outcome.result
    judged = outcome.health
    if result is None or result.error is not None or judged is None:
        return []
    vm = outcome.vm
    attempts = {job.id: job.attempt_number for job in vm.jobs}
    found: dict[int, BrokenGpu] = {}
    for uuid, row in vm.gpus.items():
        job_id = row.job_id
        if job_id is None or job_id in outcome.finished or job_id not in attempts:
            continue
        health = judged.get(uuid)
        wrong = health.condition if health is not None else None
        if wrong is None or not wrong.stops_attempt or job_id in found:
            continue
        found[job_id] = BrokenGpu(
            job_id, attempts[job_id], vm.target.name, row.values[0], uuid, wrong.reason
        )
    return list(found.values())


async def stop_on_broken_gpus(db: Database, outcomes: Sequence[Outcome]) -> int:
    """Stop the attempts on lost or faulty GPUs (one short transaction each); how many."""
    stopped = 0
    for outcome in outcomes:
        for broken in broken_gpus(outcome):
            if await _stop(db, broken):
                outcome.finished.add(broken.job_id)
                stopped += 1
    return stopped


async def _stop(db: Database, broken: BrokenGpu) -> bool:
    why = (
        f"{GPU_FAILED}: GPU {broken.gpu_index} ({broken.uuid}) on {broken.vm_name} {broken.reason}"
    )[:500]
    async with db.transaction() as session:
        row = (
            await session.execute(
                select(*AttemptRecord.columns(), Job.status)
                .where(Job.id == broken.job_id, Job.attempt == broken.attempt)
                .with_for_update()
            )
        ).first()
        if row is None or JobStatus(row.status) not in LIVE_STATES:
            return False
        end = decide(None, RankEnd(How.STOPPED, why, failure=FailureReason.GPU_FAILED))
        moved = await end_attempt(
            session, AttemptRecord.from_row(row), end, expected=LIVE_STATES, actor="poller"
        )
    if moved:
        log.warning("job_stopped_gpu_failed", job_id=broken.job_id, vm=broken.vm_name, reason=why)
        metrics.count_failure(GPU_FAILED)
    return moved
