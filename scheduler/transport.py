"""How commands reach a VM: one small interface, an SSH implementation and a local one.

Every caller goes through `Transport.run(target, command, timeout=…)`. Commands are
built by the caller with `shlex.quote` on every user-supplied piece (invariant 5).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Protocol

from scheduler.models import VM


@dataclass(frozen=True)
class VMTarget:
    """Everything needed to reach one VM, detached from any database session."""

    id: int
    name: str
    host: str
    port: int = 22
    user: str | None = None
    ssh_key_path: str | None = None
    known_hosts: str | None = None
    verify_host_key: bool = True
    transport: str = "ssh"
    python: str = "python3"
    entrypoint: str = "training.train_grpo"

    @classmethod
    def from_vm(cls, vm: VM) -> VMTarget:
        """Copy the connection fields out of a VM row."""
        return cls(
            id=vm.id,
            name=vm.name,
            host=vm.host,
            port=vm.port,
            user=vm.user,
            ssh_key_path=vm.ssh_key_path,
            known_hosts=vm.known_hosts,
            verify_host_key=vm.verify_host_key,
            transport=vm.transport,
            python=vm.python,
            entrypoint=vm.entrypoint,
        )


@dataclass(frozen=True)
class CommandResult:
    """What a remote command returned."""

    exit_status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_status == 0


class TransportError(Exception):
    """The VM could not be reached, or the command did not finish in time."""


class Transport(Protocol):
    """Runs shell commands on VMs."""

    async def run(
        self, target: VMTarget, command: str, *, timeout: float, input: str | None = None
    ) -> CommandResult:
        """Run `command` in a POSIX shell on `target`; raise `TransportError` if unreachable."""
        ...

    async def close(self) -> None:
        """Release every connection."""
        ...


class LocalTransport:
    """Runs commands on this machine with `/bin/sh -c`, for a VM that is the machine itself."""

    async def run(
        self, target: VMTarget, command: str, *, timeout: float, input: str | None = None
    ) -> CommandResult:
        """Run `command` locally, killing its process group on timeout."""
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(input.encode() if input is not None else None), timeout
            )
        except TimeoutError as exc:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise TransportError(f"{target.name}: command timed out after {timeout:.0f}s") from exc
        return CommandResult(
            proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )

    async def close(self) -> None:
        """Nothing to release."""
