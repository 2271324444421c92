"""How GPUs are picked: the one home of the placement policy. Pure, no I/O.

- **Best fit**: a node goes to the fullest VM that still has the GPUs it needs (fewest free
  GPUs first), so big free blocks stay whole for big jobs.
- **Spread**: ties between equally full VMs are broken per job (`SPREAD`), so that
  concurrent claimers spread over them instead of queueing on one.
- **Gangs**: a job over several VMs puts each node on a VM of its own, the most demanding
  node first (`demand_order`); such a placement exists exactly when `short_of` finds no
  shortage.

The claim's SQL orders its candidates with `tie_break_sql` (rendered from `SPREAD`), the
batch shortlist (`shortlist`) and the gang claim (`vm_order`) play the same order out in
Python, the pending planner (`scheduler.pending`) and `job submit` (`scheduler.submit`) ask
`place` and `short_of` whether a job fits now or could ever fit, and say why not with
`unsatisfiable_reason` / `unsatisfiable_gang_reason`. A change to how GPUs are picked is
made here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SPREAD = 2654435761
"""Knuth's multiplicative hash constant: ties between equally full VMs are broken per job,
so concurrent claimers spread over them instead of queueing on one."""

_MOD = 2**32


def tie_break_sql(vm: str, job: str) -> str:
    """The SQL expression (over the columns or parameters `vm` and `job`) by which the
    claim breaks ties between equally full VMs for one job."""
    return f"({vm} * {SPREAD} + {job}) % {_MOD}"


def vm_order(free_by_vm: dict[int, int], need: int, job_id: int) -> list[int]:
    """The VMs a node needing `need` GPUs may be placed on, best first: those with at least
    `need` free GPUs, the fullest first (fewest free GPUs, so big free blocks stay whole for
    big jobs), ties broken by a per-job hash of the VM id. A gang claim takes the first of
    the list whose GPU rows it can lock, moving down the list past VMs another claimer
    holds right now (docs/decisions.md, "Gang placement")."""
    salt = job_id * SPREAD % _MOD
    fits = [vm for vm, free in free_by_vm.items() if free >= need]
    return sorted(fits, key=lambda vm: (free_by_vm[vm], (vm * SPREAD % _MOD) ^ salt, vm))


def demand_order(demands: list[int]) -> list[int]:
    """The order in which a gang's nodes are placed: most GPUs first (ties by node).

    The VMs that fit a node are a subset of those that fit any node needing fewer GPUs, so
    placing the most demanding node first, on any VM that fits it, never blocks a placement
    that exists: the greedy placement finds one whenever `demands_fit` says so."""
    return sorted(range(len(demands)), key=lambda node: (-demands[node], node))


def short_of(free_by_vm: dict[int, int], demands: list[int]) -> tuple[int, int, int] | None:
    """Why `demands` (one GPU count per node, each node its own VM) cannot be placed on VMs
    with these free counts: (n, need, have) = the n nodes needing `need` or more GPUs find
    only `have` VMs with `need` free; None when a placement exists."""
    wanted = sorted(demands, reverse=True)
    for k, need in enumerate(wanted, start=1):
        if wanted[k : k + 1] == [need]:
            continue  # count the nodes of one size together
        have = sum(1 for free in free_by_vm.values() if free >= need)
        if have < k:
            return k, need, have
    return None


def demands_fit(free_by_vm: dict[int, int], demands: list[int]) -> bool:
    """Whether distinct VMs with these free GPU counts can host every node of `demands`."""
    return short_of(free_by_vm, demands) is None


def place(free: dict[int, int], demands: list[int]) -> list[tuple[int, int]] | None:
    """(VM, GPUs) for every node, each on a VM of its own, most demanding node first on
    the fullest VM that fits it (as the gang claim places them); None when one fits none."""
    used: set[int] = set()
    placed: list[tuple[int, int]] = []
    for need in sorted(demands, reverse=True):
        fits = [vm for vm, n in free.items() if n >= need and vm not in used]
        if not fits:
            return None
        vm = min(fits, key=lambda v: (free[v], v))
        used.add(vm)
        placed.append((vm, need))
    return placed


def could_ever_fit(vm_sizes: Sequence[int], demands: list[int]) -> bool:
    """Whether a fleet of VMs with these GPU counts could ever run a job needing `demands`
    (one GPU count per node), were every GPU free."""
    return place(dict(enumerate(vm_sizes)), demands) is not None


def shortlist(
    free_by_vm: Iterable[tuple[int, int]], jobs: Iterable[tuple[int, int]], candidates: int
) -> list[int]:
    """The VMs a batch's claims look at first: best fit played out on one count of the
    free GPUs (`free_by_vm`: (VM, free GPUs)), keeping for each job ((job id, GPUs needed),
    in id order) `candidates` of the fullest VMs that fit it, ties spread per job.

    Only a hint: each claim still locks and checks its GPU rows itself, and a claim that
    finds nothing on the shortlist searches the whole fleet."""
    by_free: dict[int, list[int]] = {}
    for vm_id, free in sorted(free_by_vm):
        by_free.setdefault(free, []).append(vm_id)
    named: set[int] = set()
    for job_id, need in jobs:
        picked: list[tuple[int, int]] = []
        for free in sorted(n for n, vms in by_free.items() if n >= need and vms):
            vms = by_free[free]
            start = job_id * SPREAD % len(vms)
            take = min(candidates - len(picked), len(vms))
            picked += [(free, vms[(start + k) % len(vms)]) for k in range(take)]
            if len(picked) >= candidates:
                break
        named.update(vm_id for _free, vm_id in picked)
        if picked:
            free, vm_id = picked[0]
            by_free[free].remove(vm_id)
            by_free.setdefault(free - need, []).append(vm_id)
    return sorted(named)


def unsatisfiable_reason(need: int, largest_vm: int) -> str:
    """Why a job can never run on the fleet as it is, in the words `job list` shows."""
    unit = "GPU" if need == 1 else "GPUs"
    return f"no VM has {need} {unit} (the largest has {largest_vm})"


def unsatisfiable_gang_reason(nodes: int, need: int, big_enough: int) -> str:
    """Why a multi-node job can never run on the fleet as it is."""
    unit = "GPU" if need == 1 else "GPUs"
    return f"needs {nodes} VMs with {need} {unit} each; only {big_enough} VM(s) have that many"
