"""What every kind of job plans for its launch (`NodeLaunch`, one per node), what it may
ask the launcher to probe on a VM while planning (`Probes`), and the one function each
kind's module exposes (`Kind`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler.attempts.shape import JobShape
from scheduler.claims.result import Claim, NodeClaim
from scheduler.remote.rendezvous import GroupLaunch, RankRendezvous
from scheduler.transport_types import VMTarget

Ports = dict[tuple[str, str], int]
"""A port chosen for each (role, port name)."""
Secret = tuple[tuple[str, str], ...]
"""Variables for every node's job.env that no command line may show (a group's token)."""


@dataclass(frozen=True)
class NodeLaunch:
    """One node of an attempt as it is started: what differs from node to node."""

    rank: int
    target: VMTarget
    gpu_indices: Sequence[int]
    gpu_uuids: Sequence[str]
    rendezvous: RankRendezvous | None = None
    """This rank's place in a multi-node job's rendezvous; None for a job of one VM or a
    group (whose supervisor gets the places of its roles' ranks)."""
    group: GroupLaunch | None = None
    """The supervisor's config for the roles that run here; None for a job not a group."""
    with_store: bool = True
    """Whether the node runs the job's store agent (a group has no store yet)."""


Plan = tuple[list[NodeLaunch], Secret] | str
"""Each node's launch and the attempt's secret variables, or why the attempt cannot start."""


class Probes(Protocol):
    """What a kind may ask of the VMs while it plans (the launcher: SSH, no transaction
    open, and the ports recorded in a transaction of their own)."""

    async def rendezvous_port(self, target: VMTarget) -> int | str:
        """A free port on `target` for a rendezvous, or why none."""
        ...

    async def choose_ports_on(
        self, claim: Claim, wanted: Sequence[tuple[VMTarget, list[tuple[str, str]]]]
    ) -> Ports | str:
        """Free ports for every (role, name) on the VM that runs it, recorded for the
        claimed attempt; or why none."""
        ...


class Kind(Protocol):
    """What a kind's module exposes to the dispatcher."""

    async def plan(
        self,
        probes: Probes,
        claim: Claim,
        shape: JobShape,
        nodes: Sequence[NodeClaim],
        targets: Sequence[VMTarget],
    ) -> Plan:
        """Each claimed node's launch (`nodes` and their VMs `targets`, rank 0 first, as
        many as `shape` has), with what it needs probed on its VM."""
        ...
