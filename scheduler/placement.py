"""How GPUs are picked: the one home of the placement policy. Pure, no I/O.

- **Eligible**: a GPU may be placed on when its VM answers and is not draining
  (`ELIGIBLE_VM_SQL`) and the GPU is healthy, not drained by an operator and not busy with
  a process rlfleet did not start (`ELIGIBLE_GPU_SQL`); `scheduler.gpus` adds that it is
  not held by a job or a leftover (`FREE_GPU`).
- **Best fit**: a rank goes to the fullest VM that still has the GPUs it needs (fewest free
  GPUs first), so big free blocks stay whole for big jobs.
- **Spread**: ties between equally full VMs are broken per job (`spread`, rendered for SQL
  by `tie_break_sql`), so that concurrent claimers spread over them instead of queueing
  on one.
- **Ranks**: an attempt puts each rank on a VM of its own, the most demanding rank first
  (`demand_order`); such a placement exists exactly when `short_of` finds no shortage. A
  single-node job is an attempt of one rank.
- **GPUs inside a VM**: a rank takes the VM's free GPUs lowest index first (`gpu_order`,
  rendered for SQL by `gpu_order_sql`).

A batch of claims (`scheduler.claims`) locks the GPU rows its `shortlist` names (best fit
played out on one count of the free GPUs), and each claim `assign`s every rank among the
rows locked; a claim that finds no room there locks candidate rows on the whole fleet, in
the order of `tie_break_sql` / `gpu_order_sql` on the VMs `lock_levels` asks for. The
pending planner (`scheduler.pending`) and `job submit` (`scheduler.submit`) ask `place`
and `short_of` whether a job fits now or could ever fit, and say why not with
`unsatisfiable_reason` / `unsatisfiable_gang_reason`. A change to how GPUs are picked is
made here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

SPREAD = 2654435761
"""Knuth's multiplicative hash constant: ties between equally full VMs are broken per job,
so concurrent claimers spread over them instead of queueing on one."""

_MOD = 2**32

ELIGIBLE_VM_SQL = "v.status = 'healthy' AND NOT v.draining"
"""The condition on VM row `v` that its GPUs may be placed on: the poller hears it, and
no operator is draining it (`vm drain`)."""

ELIGIBLE_GPU_SQL = "g.healthy AND NOT g.drained AND NOT g.foreign_busy"
"""The condition on GPU row `g` that it may be placed on: nvidia-smi says it is healthy
(`scheduler.gpu_health`), no operator drained it by hand, and no process rlfleet did not
start is using it."""


def spread(vm_id: int, job_id: int) -> int:
    """The per-job hash by which equally full VMs are ordered for one job."""
    return (vm_id * SPREAD % _MOD) ^ (job_id * SPREAD % _MOD)


def tie_break_sql(vm: str, job: str) -> str:
    """`spread` as an SQL expression over the columns or parameters `vm` and `job`."""
    return f"(({vm} * {SPREAD}) % {_MOD}) # (({job} * {SPREAD}) % {_MOD})"


def fit_key(vm_id: int, free: int, job_id: int) -> tuple[int, int, int]:
    """The best-fit order of VMs for a job: fewest free GPUs first, ties spread per job."""
    return (free, spread(vm_id, job_id), vm_id)


def gpu_order_sql(gpu: str) -> str:
    """`gpu_order` as an SQL ORDER BY list over GPU row alias `gpu`."""
    return f"{gpu}.index"


def gpu_order(gpus: Iterable[T], index: Callable[[T], int]) -> list[T]:
    """The order in which a rank takes a VM's free GPUs: lowest index first."""
    return sorted(gpus, key=index)


def vm_order(free_by_vm: dict[int, int], need: int, job_id: int) -> list[int]:
    """The VMs a rank needing `need` GPUs may be placed on, best first: those with at least
    `need` free GPUs, in best-fit order (`fit_key`: the fullest first, so big free blocks
    stay whole for big jobs, ties spread per job; docs/decisions.md, "Gang placement")."""
    fits = [vm for vm, free in free_by_vm.items() if free >= need]
    return sorted(fits, key=lambda vm: fit_key(vm, free_by_vm[vm], job_id))


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


def lock_levels(demands: Sequence[int], candidates: int) -> list[tuple[int, int]]:
    """(GPUs, VMs) for each distinct per-rank demand, most first: how many of the
    best-fitting VMs with that many free GPUs a claim locks rows on. The k ranks needing
    at least `need` GPUs take at most k of those VMs, so k + `candidates` − 1 of them leave
    room for VMs whose rows another claimer holds right now."""
    levels = sorted(set(demands), reverse=True)
    return [(need, sum(1 for d in demands if d >= need) + candidates - 1) for need in levels]


def assign(
    demands: Sequence[int],
    locked: Mapping[int, tuple[int, Sequence[T]]],
    job_id: int,
    index: Callable[[T], int],
) -> list[tuple[int, list[T]]] | None:
    """Every rank's (VM, GPUs), rank 0 first, among the GPU rows a claim locked
    (`locked`: VM → (its free GPUs, the rows locked there)): the most demanding rank first
    (`demand_order`), each on the best-fitting VM (`fit_key`) not given to another rank
    where enough rows are locked, taking them in `gpu_order`. None when some rank finds
    none. The VMs where at least n rows are locked are among those where fewer are, so the
    greedy order finds a placement whenever one exists."""
    order = sorted(locked, key=lambda vm: fit_key(vm, locked[vm][0], job_id))
    placed: dict[int, tuple[int, list[T]]] = {}
    used: set[int] = set()
    for rank in demand_order(list(demands)):
        need = demands[rank]
        vm = next((v for v in order if v not in used and len(locked[v][1]) >= need), None)
        if vm is None:
            return None
        used.add(vm)
        placed[rank] = (vm, gpu_order(locked[vm][1], index)[:need])
    return [placed[rank] for rank in range(len(demands))]


def shortlist(
    free_by_vm: Iterable[tuple[int, int]],
    jobs: Iterable[tuple[int, Sequence[int]]],
    candidates: int,
) -> dict[int, int]:
    """The GPU rows a batch of claims locks up front, as VM → how many: best fit played out
    on one count of the free GPUs (`free_by_vm`: (VM, free GPUs)), naming for each rank of
    each job ((job id, GPUs per rank), in id order; ranks most demanding first)
    `candidates` of the fullest VMs that fit it and that no earlier rank of the job took,
    ties spread per job. A VM gets as many rows as the ranks played out on it need (or, if
    more, as the most demanding rank naming it as a spare), at most its free GPUs: a batch
    holds little more than it will take.

    Only a hint: each claim still assigns its ranks among the rows actually locked, and a
    claim that finds no room there searches the whole fleet."""
    by_free: dict[int, list[int]] = {}
    free_of = dict(free_by_vm)
    for vm_id, free in sorted(free_of.items()):
        by_free.setdefault(free, []).append(vm_id)
    placed: dict[int, int] = {}
    spare: dict[int, int] = {}
    for job_id, demands in jobs:
        used: set[int] = set()
        for need in sorted(demands, reverse=True):
            picked = _pick(by_free, need, job_id, candidates, used)
            for _free, vm_id in picked[1:]:
                spare[vm_id] = max(spare.get(vm_id, 0), need)
            if picked:
                free, vm_id = picked[0]
                placed[vm_id] = placed.get(vm_id, 0) + need
                used.add(vm_id)
                by_free[free].remove(vm_id)
                by_free.setdefault(free - need, []).append(vm_id)
    named = set(placed) | set(spare)
    return {vm: min(free_of[vm], max(placed.get(vm, 0), spare.get(vm, 0))) for vm in sorted(named)}


def _pick(
    by_free: dict[int, list[int]], need: int, job_id: int, candidates: int, used: set[int]
) -> list[tuple[int, int]]:
    """Up to `candidates` (free, VM) of the fullest VMs with `need` free GPUs, not `used`,
    ties spread per job."""
    picked: list[tuple[int, int]] = []
    for free in sorted(n for n, vms in by_free.items() if n >= need and vms):
        vms = [vm for vm in by_free[free] if vm not in used] if used else by_free[free]
        if not vms:
            continue
        start = job_id * SPREAD % len(vms)
        take = min(candidates - len(picked), len(vms))
        picked += [(free, vms[(start + k) % len(vms)]) for k in range(take)]
        if len(picked) >= candidates:
            break
    return picked


def unsatisfiable_reason(need: int, largest_vm: int) -> str:
    """Why a job can never run on the fleet as it is, in the words `job list` shows."""
    unit = "GPU" if need == 1 else "GPUs"
    return f"no VM has {need} {unit} (the largest has {largest_vm})"


def unsatisfiable_gang_reason(nodes: int, need: int, big_enough: int) -> str:
    """Why a multi-node job can never run on the fleet as it is."""
    unit = "GPU" if need == 1 else "GPUs"
    return f"needs {nodes} VMs with {need} {unit} each; only {big_enough} VM(s) have that many"
