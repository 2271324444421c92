"""What every transport shares: the VM a command goes to (`VMTarget`), what it returned
(`CommandResult`, its output capped: `output_cap`), how it fails (`TransportError`) and
the interface (`Transport`). `scheduler.transport` re-exports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.logging import get_logger
from scheduler.models import DEFAULT_ENTRYPOINT, VM
from scheduler.output_cap import OUTPUT_LIMIT, Tail

log = get_logger("transport")


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
    entrypoint: str = DEFAULT_ENTRYPOINT
    internal_address: str | None = None
    """Where the other nodes of a multi-node job reach this VM; None: `host`."""
    job_user: str | None = None
    """The account its jobs run as (`scheduler.remote.jobuser`), as the row holds it:
    checked (`check_job_user`) by whatever puts it into shell text."""

    @property
    def training_address(self) -> str:
        """The address for training traffic: `internal_address`, else `host`."""
        return self.internal_address or self.host

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of the fields, which are also the VM columns they come from."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def columns(cls) -> list[Any]:
        """The VM columns to select for `from_row`: one query loads many targets."""
        return [getattr(VM, name) for name in cls.fields()]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> VMTarget:
        """A target from a row that starts with `columns()`, in that order."""
        return cls(**dict(zip(cls.fields(), row, strict=False)))

    @classmethod
    def from_vm(cls, vm: VM) -> VMTarget:
        """Copy the connection fields out of a VM row."""
        return cls(**{name: getattr(vm, name) for name in cls.fields()})


@dataclass(frozen=True)
class CommandResult:
    """What a remote command returned."""

    exit_status: int
    stdout: str
    stderr: str
    stdout_dropped: int = 0
    """Bytes of stdout printed before the `max_output` kept (`output_cap.Tail`): dropped."""
    stderr_dropped: int = 0
    """The same for stderr."""

    @classmethod
    def of(cls, exit_status: int, out: Tail, err: Tail) -> CommandResult:
        """A result from the tails a transport read."""
        return cls(exit_status, out.text(), err.text(), out.dropped, err.dropped)

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_status == 0


STREAM_ERR_BYTES = 2000
"""Most bytes of a streamed command's stderr kept (`stream`): the end of an error."""


def output_limit(max_output: int | None) -> int:
    return OUTPUT_LIMIT if max_output is None else max(0, int(max_output))


def noted(target: VMTarget, result: CommandResult) -> CommandResult:
    """`result`, noted in the log when some of its output was dropped."""
    if result.stdout_dropped or result.stderr_dropped:
        log.info(
            "command_output_capped",
            vm=target.name,
            stdout_dropped=result.stdout_dropped,
            stderr_dropped=result.stderr_dropped,
        )
    return result


class TransportError(Exception):
    """The VM could not be reached, or the command did not finish in time."""


class Transport(Protocol):
    """Runs shell commands on VMs."""

    async def run(
        self,
        target: VMTarget,
        command: str,
        *,
        timeout: float,
        input: str | None = None,
        persistent: bool = False,
        max_output: int | None = None,
    ) -> CommandResult:
        """Run `command` in a POSIX shell on `target`; raise `TransportError` if unreachable.

        `persistent` is a hint that the command is repeated often (the poll): a transport
        may keep a shell open on the VM for it. Of each of stdout and stderr, the last
        `max_output` bytes are kept (default `OUTPUT_LIMIT`), the rest counted and dropped
        as it arrives (`CommandResult.stdout_dropped`).
        """
        ...

    async def close(self) -> None:
        """Release every connection."""
        ...
