"""Fleet operations on VM rows: add, list, show, remove, drain. Used by the CLI and `up`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from scheduler.errors import BadInput, NotFound
from scheduler.models import DEFAULT_ENTRYPOINT, GPU, VM, Job
from scheduler.states import LIVE_STATES

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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

    def validate(self) -> None:
        """Raise `BadInput` for a spec no VM row may hold."""
        if not NAME_RE.match(self.name):
            raise BadInput(
                f"invalid VM name {self.name!r}: use letters, digits, '.', '_' or '-' "
                "(at most 128, starting with a letter or digit)"
            )
        if not self.host.strip():
            raise BadInput("--host must not be empty")
        if any(c.isspace() for c in self.host):
            raise BadInput(f"invalid host {self.host!r}: it contains whitespace")
        if not 1 <= self.port <= 65535:
            raise BadInput(f"invalid port {self.port}: must be between 1 and 65535")
        if self.transport not in ("ssh", "local"):
            raise BadInput(f"invalid transport {self.transport!r}: use ssh or local")
        if not self.python.strip() or not self.entrypoint.strip():
            raise BadInput("--python and --entrypoint must not be empty")


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
        query = query.options(selectinload(VM.gpus))
    vm = await session.scalar(query)
    if vm is None:
        raise NotFound(f"no VM named {name!r}")
    return vm


async def list_vms(session: AsyncSession) -> list[VM]:
    """Every VM, by name, with its GPUs."""
    return list(await session.scalars(select(VM).options(selectinload(VM.gpus)).order_by(VM.name)))


async def live_job_count(session: AsyncSession, vm_id: int) -> int:
    """How many jobs are starting or running on the VM."""
    count = await session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.vm_id == vm_id, Job.status.in_([s.value for s in LIVE_STATES]))
    )
    return int(count or 0)


async def remove_vm(session: AsyncSession, name: str, *, force: bool = False) -> None:
    """Forget a VM. Refused while jobs run there unless `force`."""
    vm = await get_vm(session, name)
    live = await live_job_count(session, vm.id)
    if live and not force:
        raise BadInput(f"VM {name!r} has {live} live job(s): drain it and wait, or pass --force")
    await session.delete(vm)


async def set_draining(session: AsyncSession, name: str, draining: bool) -> VM:
    """Drain (no new jobs) or undrain a VM."""
    vm = await get_vm(session, name)
    vm.draining = draining
    await session.flush()
    return vm


def vm_to_dict(vm: VM, *, gpus: bool = True) -> dict[str, Any]:
    """A VM as plain data, for `--json` and for display."""
    data: dict[str, Any] = {
        "name": vm.name,
        "host": vm.host,
        "port": vm.port,
        "user": vm.user,
        "transport": vm.transport,
        "status": vm.status,
        "draining": vm.draining,
        "available_gpus": vm.available_gpus,
        "consecutive_failures": vm.consecutive_failures,
        "last_polled_at": vm.last_polled_at,
        "last_seen_at": vm.last_seen_at,
        "last_error": vm.last_error,
        "launch_error": vm.launch_error,
        "removing": vm.removing,
        "ssh_key_path": vm.ssh_key_path,
        "known_hosts": vm.known_hosts,
        "verify_host_key": vm.verify_host_key,
        "python": vm.python,
        "entrypoint": vm.entrypoint,
    }
    if gpus:
        data["gpus"] = [gpu_to_dict(g) for g in vm.gpus]
    return data


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
        "foreign_busy": gpu.foreign_busy,
        "job_id": gpu.job_id,
    }
