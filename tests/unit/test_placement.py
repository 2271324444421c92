"""The placement policy's claim-time parts, pure: which VMs a claim locks rows on, how it
assigns every rank among the rows it locked (distinct VMs, best fit, GPUs lowest index
first) and the rows a batch locks up front."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.placement import assign, gpu_order, lock_levels, shortlist, spread, vm_order


@dataclass(frozen=True)
class Row:
    """A locked GPU row, as a claim holds it."""

    id: int
    index: int


def rows(vm: int, *indices: int) -> list[Row]:
    return [Row(vm * 100 + i, i) for i in indices]


def index(row: Row) -> int:
    return row.index


def test_a_claim_locks_the_best_fitting_vms_for_each_demand_with_room_to_spare() -> None:
    """A 4 + 2 + 2 gang locks rows on 1 + 3 of the best VMs with 4 free and 3 + 3 with 2
    free: the k ranks needing at least n GPUs take at most k of those VMs."""
    assert lock_levels([4, 2, 2], 4) == [(4, 4), (2, 6)]
    assert lock_levels([1], 4) == [(1, 4)]


def test_every_rank_gets_a_vm_of_its_own_most_demanding_first_gpus_lowest_index_first() -> None:
    """Locked rows on VMs with 8, 3 and 2 free: a 2 + 3 gang puts its 3-GPU rank on the
    3-free VM (the fullest that fits) and its 2-GPU rank on the 2-free VM, each taking
    its VM's locked GPUs lowest index first, whatever order they were locked in."""
    locked = {1: (8, rows(1, 0, 1, 2)), 2: (3, rows(2, 7, 1, 4)), 3: (2, rows(3, 5, 3))}
    placed = assign([2, 3], locked, job_id=9, index=index)
    assert placed == [(3, rows(3, 3, 5)), (2, rows(2, 1, 4, 7))]
    assert gpu_order(rows(2, 7, 1, 4), index) == rows(2, 1, 4, 7)


def test_a_vm_with_too_few_rows_locked_is_passed_over_and_a_gang_needs_distinct_vms() -> None:
    """A VM with 4 free whose other claimer holds all but one row cannot host a 2-GPU rank;
    two ranks never share a VM, so two 1-GPU ranks on one VM's rows do not place."""
    locked = {1: (4, rows(1, 3)), 2: (6, rows(2, 0, 1))}
    assert assign([2], locked, job_id=1, index=index) == [(2, rows(2, 0, 1))]
    assert assign([1, 1], {1: (8, rows(1, 0, 1, 2))}, job_id=1, index=index) is None
    assert assign([3], locked, job_id=1, index=index) is None


def test_equally_full_vms_are_assigned_in_the_per_job_spread_order() -> None:
    """Among equally full VMs a rank goes to the first of `vm_order` for its job, and the
    first VM differs between jobs."""
    locked = {vm: (4, rows(vm, 0, 1, 2, 3)) for vm in range(1, 9)}
    free = {vm: 4 for vm in locked}
    firsts = set()
    for job_id in range(1, 13):
        ((vm, _gpus),) = assign([2], locked, job_id, index) or []
        assert vm == vm_order(free, 2, job_id)[0]
        firsts.add(vm)
    assert len(firsts) > 3
    assert spread(3, 5) != spread(3, 6)


def test_a_batch_locks_rows_for_every_rank_on_distinct_vms_and_little_more() -> None:
    """On VMs with 2, 2, 2 and 8 free, one 2 × 2 gang's shortlist names the three 2-free
    VMs (two ranks placed, one spare) with 2 rows each and never the 8-free VM; two
    one-GPU jobs pack on one VM: it gets the 2 rows they take, each spare VM one."""
    free = [(1, 2), (2, 2), (3, 2), (4, 8)]
    assert shortlist(free, [(7, (2, 2))], 2) == {1: 2, 2: 2, 3: 2}
    packed = shortlist([(1, 8), (2, 8), (3, 8)], [(1, (1,)), (2, (1,))], 2)
    counts = sorted(packed.values(), reverse=True)
    assert counts[0] == 2 and set(counts[1:]) == {1}
