"""Each kind of job is one module here, exposing the same function the dispatcher calls
(`Kind.plan`: what each node of a claimed attempt is started with). The dispatcher picks
the module from the job's shape (`kind_of`) and never branches on the kind itself; a new
kind of job is a new module and an entry in `KINDS` (with its `JobKind` and its
`JobShape` builder in `attempts/shape.py`)."""

from __future__ import annotations

from scheduler.attempts.kinds import group, training
from scheduler.attempts.kinds.base import Kind, NodeLaunch, Plan, Ports, Probes, Secret
from scheduler.attempts.shape import JobKind, JobShape

KINDS: dict[JobKind, Kind] = {JobKind.TRAINING: training, JobKind.GROUP: group}
"""The module that plans each kind of job."""


def kind_of(shape: JobShape) -> Kind:
    """The module that plans a job of `shape`."""
    return KINDS[shape.kind]


__all__ = ["KINDS", "Kind", "NodeLaunch", "Plan", "Ports", "Probes", "Secret", "kind_of"]
