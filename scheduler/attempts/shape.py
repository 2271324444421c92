"""A job's shape: how many VMs one attempt spans and which of them run a primary role (a
role whose end is the job's end), built once from the job row's `nodes` and `roles`.

A job that is not a group has one primary rank per VM: every rank's end counts. A group's
primary ranks are the VMs of its layout (`GroupSpec.layout`) running at least one primary
role; the others run services only, which are stopped once the primaries are done. Pure:
no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.errors import BadInput
from scheduler.validate import MAX_NODES


@dataclass(frozen=True)
class JobShape:
    """The ranks (one per VM) of an attempt of a job, and which of them are primary."""

    nodes: int
    primary_ranks: frozenset[int]
    group: bool = False

    @classmethod
    def of(cls, nodes: int, roles: Any) -> JobShape:
        """The shape of a job row with `nodes` VMs and the stored `roles` (None: not a
        group). Roles that do not read back (checked at the claim, so only a row edited
        since) count every rank, as a job that is not a group does. A `nodes` out of range
        (a row edited after its claim checked it) is bounded to what a claim allows."""
        nodes = min(max(nodes, 1), MAX_NODES) if type(nodes) is int else 1
        every = frozenset(range(nodes))
        if roles is None:
            return cls(nodes, every)
        from scheduler.jobspec import parse_data

        try:
            group = parse_data(roles)
        except (BadInput, RecursionError):
            return cls(nodes, every, group=True)
        layout = group.layout()
        primary = frozenset(
            rank
            for rank, node in enumerate(layout)
            if any(group.role(name).primary for name, _rank in node.roles)
        )
        return cls(len(layout), primary or every, group=True)
