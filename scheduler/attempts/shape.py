"""A job's shape: what one attempt of it is made of, read once from the job row's `nodes`,
`gpus_requested` and `roles` (or from a spec about to become one), and carried from there
on the claim and on the live job. Nothing else reads `roles` to learn where a job runs,
nor divides `gpus_requested` (every GPU of an attempt, for every kind of job: a training
job has it shared evenly by its VMs) to learn each VM's GPUs
(`tests/unit/test_shape_home.py`).

An attempt has one rank per VM (`RankShape`): its GPUs, the roles it runs (a training job's
one `train` role, or a group's roles of its layout node, `GroupSpec.layout`) and whether it
is primary (its end is the job's end). A training job's every rank is primary; a group's
ranks are primary when they run at least one primary role (the others run services only,
stopped once the primaries are done).

A row whose roles do not read back, or disagree with its other columns (a row edited by
hand since its claim checked it), still has a shape — every rank primary, as a training
job's — and says why in `problem`: a claim fails such a job, every other reader treats it
as what it can. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from scheduler.errors import BadInput
from scheduler.validate import MAX_GPUS, MAX_JOB_GPUS, MAX_NODES, UnreadableJson, last_words

if TYPE_CHECKING:
    from scheduler.jobspec import GroupSpec

TRAIN_ROLE = "train"
"""The one role of a training job (a job without `roles`)."""


class SpecLike(Protocol):
    """A job about to be submitted (`jobstore.JobSpec`, which imports this module)."""

    @property
    def gpus(self) -> int: ...
    @property
    def nodes(self) -> int: ...
    @property
    def roles(self) -> dict[str, Any] | None: ...


class JobKind(StrEnum):
    """What a job is: one training role (on one VM or several), or a group of roles."""

    TRAINING = "training"
    GROUP = "group"


@dataclass(frozen=True)
class RankShape:
    """One rank (VM) of an attempt: the GPUs it needs, the roles it runs as (role name,
    that role's rank), and whether its end is the job's end."""

    rank: int
    gpus: int
    roles: tuple[tuple[str, int], ...]
    primary: bool


@dataclass(frozen=True)
class JobShape:
    """Every rank of an attempt of a job, rank 0 first, and what kind of job it is."""

    kind: JobKind
    ranks: tuple[RankShape, ...]
    spec: GroupSpec | None = None
    """A group's roles, parsed once (None: a training job, or roles that did not read)."""
    problem: str | None = None
    """Why the row cannot be launched as it is (None: it can)."""

    # -- what every reader asks -----------------------------------------------------------

    @property
    def nodes(self) -> int:
        """How many VMs (ranks) one attempt spans."""
        return len(self.ranks)

    @property
    def demands(self) -> tuple[int, ...]:
        """The GPUs each rank needs, rank 0 first."""
        return tuple(r.gpus for r in self.ranks)

    @property
    def gpus(self) -> int:
        """Every GPU an attempt holds."""
        return sum(self.demands)

    @property
    def primary_ranks(self) -> frozenset[int]:
        """The ranks whose end is the job's end."""
        return frozenset(r.rank for r in self.ranks if r.primary)

    @property
    def group(self) -> bool:
        """Whether the job is a group of roles."""
        return self.kind is JobKind.GROUP

    @property
    def multi_node(self) -> bool:
        """Whether an attempt spans more than one VM."""
        return len(self.ranks) > 1

    def ranks_of(self, role: str) -> tuple[int, ...]:
        """The ranks (VMs) running `role`, its rank 0 first; () for no such role."""
        found = sorted(
            (r_rank, r.rank) for r in self.ranks for name, r_rank in r.roles if name == role
        )
        return tuple(rank for _role_rank, rank in found)

    @property
    def role_names(self) -> tuple[str, ...]:
        """The job's roles, in the order of its spec (a training job: `train`)."""
        if self.spec is not None:
            return tuple(r.name for r in self.spec.roles)
        return (TRAIN_ROLE,)

    # -- building one ---------------------------------------------------------------------

    @classmethod
    def training(cls, gpus_per_node: int, nodes: int = 1) -> JobShape:
        """A training job: `nodes` ranks of `gpus_per_node` GPUs each, every one primary."""
        return cls(
            JobKind.TRAINING,
            tuple(
                RankShape(rank, gpus_per_node, ((TRAIN_ROLE, rank),), True) for rank in range(nodes)
            ),
        )

    @classmethod
    def of_group(cls, spec: GroupSpec) -> JobShape:
        """A group laid out on VMs (`GroupSpec.layout`)."""
        ranks = tuple(
            RankShape(
                rank,
                node.gpus,
                node.roles,
                any(spec.role(name).primary for name, _r in node.roles),
            )
            for rank, node in enumerate(spec.layout())
        )
        if not any(r.primary for r in ranks):  # parse_data refuses this; a row edited since
            ranks = tuple(RankShape(r.rank, r.gpus, r.roles, True) for r in ranks)
        return cls(JobKind.GROUP, ranks, spec=spec)

    @classmethod
    def of_row(cls, row: Any) -> JobShape:
        """The shape of a job row (anything with `nodes`, `gpus_requested` and `roles`)."""
        return cls.of(row.nodes, row.roles, getattr(row, "gpus_requested", 1))

    @classmethod
    def of_spec(cls, spec: SpecLike) -> JobShape:
        """The shape of a job about to be submitted (`jobstore.JobSpec`: `gpus` on each of
        its `nodes` for a training job, the stored `roles` for a group); `BadInput` for
        roles that do not read."""
        if spec.roles is None:
            return cls.training(spec.gpus, spec.nodes)
        from scheduler.jobspec import parse_data

        return cls.of_group(parse_data(spec.roles))

    @classmethod
    def of(cls, nodes: Any, roles: Any, gpus: Any = 1) -> JobShape:
        """The shape of a job row with `nodes` VMs, `gpus` GPUs (`gpus_requested`: every GPU
        of an attempt, all its VMs together, for every kind of job) and the stored `roles`
        (None: a training job, `gpus / nodes` on each VM). Values out of range (a row edited
        after its claim checked it) are bounded to what a claim allows, and named in
        `problem`."""
        problem = None
        if type(nodes) is not int or not 1 <= nodes <= MAX_NODES:
            problem = f"nodes must be between 1 and {MAX_NODES}, not {nodes!r}"
            nodes = min(max(nodes, 1), MAX_NODES) if type(nodes) is int else 1
        if type(gpus) is not int or not 1 <= gpus <= MAX_JOB_GPUS:
            problem = (
                problem or f"gpus_requested must be between 1 and {MAX_JOB_GPUS}, not {gpus!r}"
            )
            gpus = min(max(gpus, 1), MAX_JOB_GPUS) if type(gpus) is int else 1
        if roles is None:
            return _training_of_row(nodes, gpus, problem)
        return _group_of_row(nodes, roles, gpus, problem)


def _training_of_row(nodes: int, gpus: int, problem: str | None) -> JobShape:
    """A training row's shape: `gpus` shared evenly by its `nodes` VMs; a total that does
    not divide, or more than a VM may be asked for, is named in `problem`."""
    each = max(1, gpus // nodes)
    if gpus % nodes:
        problem = problem or f"gpus_requested {gpus} is not the same GPUs on each of {nodes} VMs"
    elif each > MAX_GPUS:
        problem = problem or f"gpus_requested {gpus} is more than {MAX_GPUS} GPUs on a VM"
    shape = JobShape.training(min(each, MAX_GPUS), nodes)
    return shape if problem is None else JobShape(shape.kind, shape.ranks, problem=problem)


def _group_of_row(nodes: int, roles: Any, gpus: int, problem: str | None) -> JobShape:
    """A group row's shape; a row whose roles do not read back, or that disagrees with
    its `nodes` or `gpus_requested`, has every rank primary and says why."""
    from scheduler.jobspec import parse_data

    fallback = JobShape.training(min(MAX_GPUS, max(1, gpus // nodes)), nodes)
    if isinstance(roles, UnreadableJson):  # too deep or too long to decode
        return JobShape(JobKind.GROUP, fallback.ranks, problem=f"roles: {roles.problem}")
    try:
        spec = parse_data(roles)
    except BadInput as exc:
        return JobShape(JobKind.GROUP, fallback.ranks, problem=f"roles: {exc}")
    except (ValueError, TypeError, RecursionError) as exc:  # a row no file could give
        why = f"roles: cannot be read ({last_words(exc)})"
        return JobShape(JobKind.GROUP, fallback.ranks, problem=why)
    shape = JobShape.of_group(spec)
    if shape.nodes != nodes:
        problem = problem or f"roles run on {shape.nodes} VM(s), the row asks for {nodes!r}"
    elif shape.gpus != gpus and not (shape.nodes == 1 and spec.gpus == gpus):
        problem = problem or f"roles need {shape.gpus} GPUs, the row asks for {gpus}"
    return shape if problem is None else JobShape(shape.kind, shape.ranks, spec, problem)
