"""Fleet operations on VM rows: add, list, show, remove, drain. Used by the CLI and `up`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, delete, exists, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.errors import BadInput, NotFound
from scheduler.gpus import refresh_available_in_session
from scheduler.leftovers import open_leftover_count, open_leftover_on_vm
from scheduler.models import DEFAULT_ENTRYPOINT, GPU, VM, GpuEvent, Job, JobNode
from scheduler.remote.jobuser import job_user_problem
from scheduler.states import LIVE_STATES, FailureReason, JobStatus
from scheduler.validate import check_text

NAME_RE = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z"
)  # \Z: `$` matches before a final newline


@dataclass(frozen=True)
class VMSpec:
    """What a user gives to register a VM."""

    name: str
    host: str
    port: int = 22
    user: str | None = None
    ssh_key_path: str | None = None
    known_hosts: str | None = None
    verify_host_key: bool = True
    transport: str = "ssh"
    python: str = "python3"
    entrypoint: str = DEFAULT_ENTRYPOINT
    internal_address: str | None = None
    """Where the other nodes of a multi-node job reach this VM; None: `host`."""
    job_user: str | None = None
    """The Unix account its jobs run as (`scheduler.remote.jobuser`); None: `user`."""

    def validate(self) -> None:
        """Raise `BadInput` for a spec no VM row may hold."""
        check_vm_name(self.name)
        check_text(self.host, "--host", column=VM.host)
        if self.user is not None:
            check_text(self.user, "--user", column=VM.user)
        for value, what, column in (
            (self.ssh_key_path, "--ssh-key", VM.ssh_key_path),
            (self.known_hosts, "--known-hosts", VM.known_hosts),
            (self.python, "--python", VM.python),
            (self.entrypoint, "--entrypoint", VM.entrypoint),
        ):
            if value is not None:
                check_text(value, what, column=column)
        if not NAME_RE.match(self.name):
            raise BadInput(
                f"invalid VM name {self.name!r}: use letters, digits, '.', '_' or '-' "
                "(at most 128, starting with a letter or digit)"
            )
        if not self.host.strip():
            raise BadInput("--host must not be empty")
        if any(c.isspace() for c in self.host):
            raise BadInput(f"invalid host {self.host!r}: it contains whitespace")
        if self.job_user is not None:
            check_job_user_input(self.job_user)
        if self.internal_address is not None:
            check_text(self.internal_address, "--internal-address", column=VM.internal_address)
            if not self.internal_address.strip() or any(c.isspace() for c in self.internal_address):
                raise BadInput(
                    f"invalid internal address {self.internal_address!r}: it must be a "
                    "hostname or IP address without whitespace"
                )
        if not 1 <= self.port <= 65535:
            raise BadInput(f"invalid port {self.port}: must be between 1 and 65535")
        if self.transport not in ("ssh", "local"):
            raise BadInput(f"invalid transport {self.transport!r}: use ssh or local")
        if not self.python.strip() or not self.entrypoint.strip():
            raise BadInput("--python and --entrypoint must not be empty")


def check_vm_name(name: str) -> str:
    """`name` if a VM row can hold it (UTF-8, at most the column's length); else `BadInput`.
    Lookups check names this way too: a name no row can hold names no VM."""
    return check_text(name, "VM name", column=VM.name)


async def add_vm(session: AsyncSession, spec: VMSpec) -> VM:
    """Register a VM; a duplicate name is `BadInput`."""
    spec.validate()
    if await session.scalar(select(VM.id).where(VM.name == spec.name)) is not None:
        raise BadInput(f"a VM named {spec.name!r} already exists")
    vm = VM(**spec.__dict__)
    session.add(vm)
    try:
        await session.flush()
    except IntegrityError as exc:  # a concurrent add of the same name
        raise BadInput(f"a VM named {spec.name!r} already exists") from exc
    return vm


async def get_vm(session: AsyncSession, name: str, *, with_gpus: bool = False) -> VM:
    """The VM called `name`, or `NotFound`."""
    query = select(VM).where(VM.name == name)
    if with_gpus:
        query = query.options(selectinload(VM.gpus), selectinload(VM.poller))
    vm = await session.scalar(query)
    if vm is None:
        raise NotFound(f"no VM named {name!r}")
    return vm


async def list_vms(
    session: AsyncSession, *, name: str | None = None, limit: int | None = None, offset: int = 0
) -> list[VM]:
    """Every VM, by name, with its GPUs; with `name`, those whose name contains it
    (case-insensitive, taken literally); `limit` and `offset` take one page of them."""
    query = (
        select(VM)
        .options(selectinload(VM.gpus), selectinload(VM.poller))
        .order_by(VM.name)
        .offset(offset)
    )
    if name:
        query = query.where(VM.name.icontains(name, autoescape=True))
    if limit is not None:
        query = query.limit(limit)
    return list(await session.scalars(query))


def gpu_state(gpu: GPU) -> str:
    """What a GPU is to the scheduler now: `unhealthy`, `allocated` (to a job), `drained`
    (taken out by hand), `foreign` (a process rlfleet did not start uses it) or `free`."""
    if not gpu.healthy:
        return "unhealthy"
    if gpu.job_id is not None:
        return "allocated"
    if gpu.drained:
        return "drained"
    return "foreign" if gpu.foreign_busy else "free"


GPU_EVENTS_SHOWN = 20
"""How many of a VM's latest GPU events `vm show` prints."""


def find_gpu(vm: VM, which: str) -> GPU:
    """The GPU of `vm` (its GPUs loaded) named by `which`: its UUID (or a unique prefix of
    at least 8 characters), or nvidia-smi's index at the last poll; else `BadInput`."""
    text = which.strip()
    if text.isdigit() and text.isascii():
        found = [g for g in vm.gpus if g.index == int(text)]
    elif len(text) >= 8:
        found = [g for g in vm.gpus if g.uuid.lower().startswith(text.lower())]
    else:
        found = []
    if len(found) != 1:
        known = ", ".join(f"{g.index} ({g.uuid})" for g in vm.gpus) or "none known yet"
        raise BadInput(f"VM {vm.name!r} has no GPU {which[:100]!r}; its GPUs: {known}"[:400])
    return found[0]


async def set_gpu_draining(session: AsyncSession, name: str, which: str, draining: bool) -> GPU:
    """Take one GPU of VM `name` out by hand (`vm drain NAME --gpu`: a job on it finishes,
    no new one starts there) or bring it back; recorded as a GPU event."""
    query = select(VM).where(VM.name == name).options(selectinload(VM.gpus))
    vm = await session.scalar(query)
    if vm is None:
        raise NotFound(f"no VM named {name!r}")
    gpu = find_gpu(vm, which)
    if gpu.drained != draining:
        gpu.drained = draining
        kind = "drained" if draining else "undrained"
        session.add(
            GpuEvent(
                vm_id=vm.id,
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                kind=kind,
                reason=f"{kind} by hand",
                actor="cli",
            )
        )
        await session.flush()
        await refresh_available_in_session(session, {vm.id})
    return gpu


async def gpu_events(
    session: AsyncSession, vm_id: int, limit: int = GPU_EVENTS_SHOWN
) -> list[dict[str, Any]]:
    """The VM's latest GPU events, newest first, as plain data."""
    rows = await session.scalars(
        select(GpuEvent)
        .where(GpuEvent.vm_id == vm_id)
        .order_by(GpuEvent.created_at.desc(), GpuEvent.id.desc())
        .limit(limit)
    )
    return [
        {
            "at": e.created_at,
            "gpu_index": e.gpu_index,
            "gpu_uuid": e.gpu_uuid,
            "kind": e.kind,
            "reason": e.reason,
            "actor": e.actor,
        }
        for e in rows
    ]


def runs_on(vm_id: Any) -> ColumnElement[bool]:
    """Whether the job is live with a rank of its current attempt on the VM (`job_nodes`:
    any rank, rank 0 like the others)."""
    return Job.status.in_([s.value for s in LIVE_STATES]) & Job.id.in_(
        select(JobNode.job_id).where(JobNode.vm_id == vm_id, JobNode.attempt == Job.attempt)
    )


async def live_job_count(session: AsyncSession, vm_id: int) -> int:
    """How many jobs are starting or running on the VM (any of their ranks)."""
    count = await session.scalar(select(func.count()).select_from(Job).where(runs_on(vm_id)))
    return int(count or 0)


@dataclass(frozen=True)
class Removal:
    """What `remove_vm` did: `removed` (the row is gone) or `removing` (its jobs failed,
    the row goes once their processes are killed), and the jobs it failed."""

    outcome: str
    failed_jobs: list[int]
    leftovers: int = 0
    """Processes still to be killed (for `removing`), or given up on (for `removed`)."""


VM_REMOVED = FailureReason.VM_REMOVED.value


async def fail_jobs_of_removed_vm(
    session: AsyncSession, vm_id: int, vm_name: str, *, actor: str
) -> list[int]:
    """Fail the live jobs with a rank on a VM being removed (`runs_on`) with `vm_removed`
    (caller's transaction): GPUs freed, and every rank of each attempt recorded as a
    leftover, so that it is killed when its VM answers and its job is not run again until
    then (docs/invariants.md, invariant 2). Returns the ids of the jobs failed."""
    rows = (
        await session.execute(
            select(*AttemptRecord.columns(), Job.status)
            .where(runs_on(vm_id))
            .order_by(Job.id)
            .with_for_update()
        )
    ).all()
    why = f"{VM_REMOVED}: VM {vm_name} was removed while the job ran"
    failed = []
    end = decide(None, RankEnd(How.REMOVED, why))
    for row in rows:
        if await end_attempt(
            session, AttemptRecord.from_row(row), end, expected=JobStatus(row.status), actor=actor
        ):
            failed.append(row.id)
    return failed


async def remove_vm(
    session: AsyncSession, name: str, *, force: bool = False, actor: str = "cli"
) -> Removal:
    """Forget a VM. Refused (`BadInput`) while jobs run there or processes of earlier
    attempts are still to be killed, unless `force`.

    With `force` the VM is drained and marked `removing`, its jobs fail with `vm_removed`
    (retried elsewhere without using up a retry) and the requeue manager deletes the row
    once their processes are killed: the records of what to kill live in rows that the
    deletion would cascade away. `force` on a VM already `removing` deletes it at once,
    giving up on killing what it may still run."""
    vm = await session.scalar(select(VM).where(VM.name == name).with_for_update())
    if vm is None:
        raise NotFound(f"no VM named {name!r}")
    live = await live_job_count(session, vm.id)
    leftovers = await open_leftover_count(session, vm.id)
    if not force and (live or leftovers):
        what = " and ".join(
            text
            for n, text in (
                (live, f"{live} live job(s)"),
                (leftovers, f"{leftovers} process(es) of earlier attempts not yet killed"),
            )
            if n
        )
        raise BadInput(
            f"VM {name!r} has {what}: drain it and wait, or pass --force "
            f"to fail its jobs ({VM_REMOVED}, retried elsewhere) and kill their processes"
        )
    if (not live and not leftovers) or vm.removing:
        await fail_jobs_of_removed_vm(session, vm.id, vm.name, actor=actor)
        await session.delete(vm)
        return Removal("removed", [], leftovers)
    vm.removing = True
    vm.draining = True
    failed = await fail_jobs_of_removed_vm(session, vm.id, vm.name, actor=actor)
    await session.flush()
    return Removal("removing", failed, await open_leftover_count(session, vm.id))


async def delete_removed_vms(session: AsyncSession, *, actor: str) -> list[str]:
    """The requeue manager's part of `vm remove --force` (caller's transaction): fail any
    job that reached a `removing` VM after all (a claim racing the removal), and delete
    the `removing` VMs with nothing left to kill. Returns the names deleted."""
    removing = (await session.execute(select(VM.id, VM.name).where(VM.removing))).all()
    for vm_id, vm_name in removing:
        await fail_jobs_of_removed_vm(session, vm_id, vm_name, actor=actor)
    if not removing:
        return []
    live_job = exists().where(runs_on(VM.id))
    deleted = await session.execute(
        delete(VM)
        .where(VM.removing, ~open_leftover_on_vm(VM.id), ~live_job)
        .returning(VM.name)
        .execution_options(synchronize_session=False)
    )
    return list(deleted.scalars())


def check_job_user_input(name: str) -> str:
    """`name` if it can be a job user (`jobuser.job_user_problem`); else `BadInput`."""
    problem = job_user_problem(name)
    if problem is not None:
        raise BadInput(problem)
    return name


async def set_job_user(session: AsyncSession, name: str, job_user: str | None) -> VM:
    """Set (or, with None, clear) the job user of VM `name`: the next launches and kills
    on it use it. Refused (`BadInput`) while a job runs on the VM."""
    if job_user is not None:
        check_job_user_input(job_user)
    vm = await get_vm(session, name)
    running = await live_job_count(session, vm.id) if vm.job_user != job_user else 0
    if running:
        # A kill signals J's processes as the VM's job user at the time: changing it under
        # a running attempt would leave some of that attempt's processes out of reach.
        raise BadInput(
            f"VM {name!r} runs {running} job(s): drain it (`rlfleet vm drain {name}`) and "
            "change its job user once they have ended"
        )
    vm.job_user = job_user
    await session.flush()
    return vm


async def set_draining(session: AsyncSession, name: str, draining: bool) -> VM:
    """Drain (no new jobs) or undrain a VM; a VM being removed stays drained."""
    vm = await get_vm(session, name)
    if vm.removing and not draining:
        raise BadInput(f"VM {name!r} is being removed; add it again once it is gone")
    vm.draining = draining
    await session.flush()
    return vm


def vm_to_dict(vm: VM, *, gpus: bool = True) -> dict[str, Any]:
    """A VM as plain data, for `--json` and for display."""
    data: dict[str, Any] = {
        "id": vm.id,
        "name": vm.name,
        "host": vm.host,
        "internal_address": vm.internal_address,
        "port": vm.port,
        "user": vm.user,
        "transport": vm.transport,
        "status": vm.status,
        "draining": vm.draining,
        "available_gpus": vm.available_gpus,
        "consecutive_failures": vm.consecutive_failures,
        "poller": _poller_name(vm),
        "last_polled_at": vm.last_polled_at,
        "last_seen_at": vm.last_seen_at,
        "last_error": vm.last_error,
        "launch_error": vm.launch_error,
        "process_tracking": vm.process_tracking,
        "removing": vm.removing,
        "ssh_key_path": vm.ssh_key_path,
        "known_hosts": vm.known_hosts,
        "verify_host_key": vm.verify_host_key,
        "python": vm.python,
        "entrypoint": vm.entrypoint,
        "job_user": vm.job_user,
    }
    if gpus:
        data["gpus"] = [gpu_to_dict(g) for g in vm.gpus]
    return data


def _poller_name(vm: VM) -> str | None:
    """The name (`host:pid`) of the poller holding the VM, when loaded; None: no poller
    holds it (none runs, or it was freed and not taken yet)."""
    if "poller" not in vm.__dict__:  # not loaded with the VM
        return None
    return vm.poller.name if vm.poller is not None else None


def gpu_to_dict(gpu: GPU) -> dict[str, Any]:
    """A GPU row as plain data."""
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "memory_total_mb": gpu.memory_total_mb,
        "memory_used_mb": gpu.memory_used_mb,
        "utilization_pct": gpu.utilization_pct,
        "healthy": gpu.healthy,
        "health_reason": gpu.health_reason
        or (None if gpu.healthy else "its VM cannot be trusted (see the VM's last_error)"),
        "health_changed_at": gpu.health_changed_at,
        "ecc_uncorrected": gpu.ecc_uncorrected,
        "drained": gpu.drained,
        "foreign_busy": gpu.foreign_busy,
        "job_id": gpu.job_id,
        "state": gpu_state(gpu),
    }
