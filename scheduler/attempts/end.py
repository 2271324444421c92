"""The end of an attempt: the one rule. Pure: no I/O.

Something ended a rank of an attempt, or the attempt as a whole (`RankEnd`: how, which
rank); given the job's shape (which roles that rank runs, which ranks are primary, what
kind of job it is) and the exit codes known of the attempt's other ranks, `decide` says
what becomes of the attempt (`End`): it SUCCEEDS, FAILS (a `FailureReason`, whose retry
class says whether the retry is counted, `scheduler.retry`), GOES ON, goes back to the
queue (a claim whose launch was never confirmed), or is CANCELLED; and, when it moves,
which ranks are known to have ended and why the others are left over (to be killed,
their GPUs blocked until then). `attempts.finish.end_attempt` carries the answer out.

Shared fate, the rule of every role today (`Fate.SHARED`): a rank that fails fails the
whole attempt, and every other rank that may run is left over. The exit of one unit (a
rank here; a role on one VM in the group supervisor, which runs on the VM and cannot
import the scheduler) is judged by ONE function, `scheduler.supervisor.unit_exit`, which
both call: a unit that exits non-zero fails; a unit that is not primary (a group's
services) exiting 0 while a primary still runs fails too (its services are gone); the
attempt succeeds once every primary unit exited 0 (`attempts.outcome`). `fate_of` is the
one place a role of another fate (an elastic one, whose rank may end without ending the
attempt) would change that."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from scheduler.attempts.outcome import succeeded
from scheduler.attempts.shape import JobShape
from scheduler.retry import counts_against_limit
from scheduler.states import FAILURE_RETRY, FailureReason, JobStatus, RetryClass
from scheduler.supervisor import FAILS, SUCCEEDS, unit_exit


class How(StrEnum):
    """How a rank (or the attempt as a whole) ended."""

    EXITED = "exited"
    """Its process exited: `exit_code` 0, or the failure its probe classified."""
    STOPPED = "stopped"
    """The scheduler stops it (hung, stuck starting, its GPU failed): it may still run."""
    LOST = "lost"
    """Its VM has not answered for too long (`node_lost`)."""
    REMOVED = "removed"
    """Its VM was removed under it (`vm_removed`)."""
    LAUNCH_REFUSED = "launch_refused"
    """Its launch failed (`launch_failed`): it may have started after all."""
    LEASE_EXPIRED = "lease_expired"
    """Its claim's launch was never confirmed: the job is claimed again."""
    CANCELLED = "cancelled"
    """The user cancelled the job."""


class Outcome(StrEnum):
    """What becomes of the attempt."""

    SUCCEEDS = "succeeds"
    FAILS = "fails"
    GOES_ON = "goes_on"
    REQUEUED = "requeued"
    CANCELLED = "cancelled"


class Fate(StrEnum):
    """What a role's failure does to its attempt."""

    SHARED = "shared"
    """It ends the attempt: every rank of it stops (every role today)."""


_MOVES = {
    Outcome.SUCCEEDS: JobStatus.COMPLETED,
    Outcome.FAILS: JobStatus.FAILED,
    Outcome.REQUEUED: JobStatus.QUEUED,
    Outcome.CANCELLED: JobStatus.CANCELLED,
}

_FAILURE_OF = {
    How.LOST: FailureReason.NODE_LOST,
    How.REMOVED: FailureReason.VM_REMOVED,
    How.LAUNCH_REFUSED: FailureReason.LAUNCH_FAILED,
}
"""The failure of an end whose reason its kind alone gives."""


@dataclass(frozen=True)
class RankEnd:
    """What ended: `how`, at which rank (None: the attempt as a whole, or a rank not
    known), with which exit code and failure (an exited or stopped rank's), and `why`,
    the one line the job's status shows."""

    how: How
    why: str
    rank: int | None = None
    exit_code: int | None = None
    failure: FailureReason | None = None
    may_run: bool = True
    """Whether a process of the attempt may still run (a cancel of a queued job: no)."""


@dataclass(frozen=True)
class End:
    """The decision: what becomes of the attempt, and what its end leaves behind."""

    outcome: Outcome
    why: str
    failure: FailureReason | None = None
    exit_code: int | None = None
    leftover: str | None = None
    """Why the ranks not in `ended` are left over to kill (None: nothing left to kill)."""
    ended: frozenset[int] = field(default_factory=frozenset)
    """Ranks known to have ended: nothing of them is left to kill."""

    @property
    def to(self) -> JobStatus | None:
        """The job's next state (None: the attempt goes on)."""
        return _MOVES.get(self.outcome)

    @property
    def retry(self) -> RetryClass | None:
        """The failure's retry class (None: not a failure)."""
        return None if self.failure is None else FAILURE_RETRY[self.failure]

    @property
    def counted(self) -> bool | None:
        """Whether retrying the failure uses up one of the job's retries (None: none)."""
        if self.failure is None:
            return None
        return counts_against_limit(self.failure.value, self.exit_code)


def fate_of(shape: JobShape, rank: int) -> Fate:
    """What the failure of `rank` (the roles it runs) does to the attempt: the one place
    an elastic role would answer otherwise (from its spec, `shape.spec`)."""
    return Fate.SHARED


def decide(
    shape: JobShape | None, end: RankEnd, codes: Mapping[int, int | None] | None = None
) -> End:
    """What becomes of an attempt of a job of `shape` after `end`, given the exit code
    known of each of its ranks (`codes`; the ended rank's own is taken from `end`). Only
    an exit needs the shape and the codes: every other end stops the whole attempt."""
    if end.how is How.EXITED:
        if shape is None:
            raise ValueError("an exited end needs the job's shape")
        return _exited(shape, end, codes or {})
    if end.how is How.LEASE_EXPIRED:
        return End(Outcome.REQUEUED, end.why, leftover=end.how.value)
    if end.how is How.CANCELLED:
        return End(Outcome.CANCELLED, end.why, leftover=end.how.value if end.may_run else None)
    failure = _FAILURE_OF.get(end.how, end.failure)
    if failure is None:
        raise ValueError(f"a {end.how.value} end needs its failure reason")
    # The process may run on: every rank, this one included, is left over.
    return End(Outcome.FAILS, end.why, failure, leftover=failure.value)


def _exited(shape: JobShape, end: RankEnd, codes: Mapping[int, int | None]) -> End:
    """A rank whose process exited (0, or failed as `end.failure` says)."""
    if end.rank is None:
        raise ValueError("an exited end names its rank")
    failed = end.failure is not None
    known = dict(codes)
    known[end.rank] = end.exit_code if failed else 0
    # A failure is a non-zero exit to the rule, whatever code (if any) it came with.
    code = (end.exit_code or 1) if failed else 0
    shared = fate_of(shape, end.rank) is Fate.SHARED
    primary = end.rank in shape.primary_ranks
    step = unit_exit(primary, code, not failed and succeeded(shape, known), shared=shared)
    ended = frozenset(r for r, c in known.items() if c is not None)
    if step == SUCCEEDS:
        # Only ranks that are not primary (a group's services) can still run.
        return End(Outcome.SUCCEEDS, end.why, exit_code=0, leftover="group_done", ended=ended)
    if step != FAILS:
        return End(Outcome.GOES_ON, end.why)
    if not failed:  # a service rank that exited 0 while a primary runs
        why = f"rank {end.rank} ({end.why}) runs services only and ended while a primary ran"
        return End(Outcome.FAILS, why, FailureReason.EXIT_NONZERO, leftover="rank_failed",
                   ended=frozenset({end.rank}))  # fmt: skip
    return End(Outcome.FAILS, end.why, end.failure, end.exit_code, "rank_failed",
               frozenset({end.rank}))  # fmt: skip
