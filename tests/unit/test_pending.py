"""The pending planner, as a table: which pending jobs wake, and which a starving job
holds back."""

from __future__ import annotations

import pytest

from scheduler.pending import PendingJob, plan_pending


def pj(
    job_id: int, gpus: int = 1, priority: int = 0, waited: float = 1, since: float = 10
) -> PendingJob:
    """A pending job as the planner sees it."""
    return PendingJob(job_id, gpus, priority, waited_s=waited, since_pending_s=since)


PLAN = {"recheck_after_s": 2.0, "pending_timeout_s": 60.0, "starvation_after_s": 300.0}


@pytest.mark.parametrize(
    ("jobs", "free", "expected"),
    [
        # one free GPU wakes one job, not every job that could use it
        ([pj(1), pj(2)], {10: 1}, [(1, "capacity")]),
        # a 2-GPU job takes the VM where it fits best; the 1-GPU one fits on the other
        ([pj(1, gpus=2), pj(2)], {10: 4, 11: 2}, [(1, "capacity"), (2, "capacity")]),
        # what does not fit is skipped, what fits after it still wakes
        ([pj(1, gpus=4), pj(2)], {10: 2}, [(2, "capacity")]),
        # a job a dispatcher just looked at is not woken again at once, but keeps its GPU
        ([pj(1, since=0.5), pj(2)], {10: 1}, []),
        # after the pending timeout a job is looked at again even with no capacity
        ([pj(1, gpus=8, since=61)], {10: 1}, [(1, "timeout")]),
        # nothing free, nothing old: nothing to do
        ([pj(1), pj(2)], {}, []),
    ],
)
def test_plan_pending_table(
    jobs: list[PendingJob], free: dict[int, int], expected: list[tuple[int, str]]
) -> None:
    """Given pending jobs (by priority then age) and free GPUs per VM, the right jobs wake."""
    assert plan_pending(jobs, free, **PLAN).republish == expected


def test_a_starving_job_holds_back_the_ones_behind_it() -> None:
    """Given a 4-GPU job pending for longer than the starvation limit, the small jobs
    behind it are held back even though a GPU is free, so GPUs pile up for it."""
    plan = plan_pending([pj(1), pj(2, gpus=4, waited=400), pj(3), pj(4)], {10: 2}, **PLAN)
    assert plan.republish == [(1, "capacity")]
    assert (plan.held_for, plan.held) == (2, [3, 4])


def test_a_job_no_vm_can_ever_run_holds_nobody_back() -> None:
    """A starving 4-GPU job holds smaller ones back only while some VM has 4 GPUs."""
    jobs = [pj(1, gpus=4, waited=400), pj(2)]
    assert plan_pending(jobs, {10: 2}, **PLAN, largest_vm=4).held == [2]
    plan = plan_pending(jobs, {10: 2}, **PLAN, largest_vm=2)
    assert plan.held is None and plan.republish == [(2, "capacity")]


def test_a_group_over_vms_wakes_when_each_node_fits_a_vm_of_its_own() -> None:
    """Nodes of 3 and 1 GPUs: woken by VMs with 3 and 1 free, not by one VM with 4 free
    (each node needs a VM of its own), nor by two with 2."""
    job = PendingJob(1, 4, 0, waited_s=10, since_pending_s=10, nodes=2, demands=(3, 1))
    knobs = {"recheck_after_s": 1, "pending_timeout_s": 1000, "starvation_after_s": 1000}
    assert plan_pending([job], {1: 3, 2: 1}, **knobs).republish == [(1, "capacity")]
    assert plan_pending([job], {1: 4}, **knobs).republish == []
    assert plan_pending([job], {1: 2, 2: 2}, **knobs).republish == []
