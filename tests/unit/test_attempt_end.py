"""`attempts.end.decide`, the one end-of-attempt rule: every kind of job × every way a rank
(or the attempt) ends, and the group supervisor's per-VM rule seen to be the same rule."""

from __future__ import annotations

import itertools

import pytest

from scheduler.attempts.end import End, How, Outcome, RankEnd, decide
from scheduler.attempts.shape import JobKind, JobShape, RankShape
from scheduler.jobspec import GroupSpec, Role
from scheduler.states import FailureReason, JobStatus, RetryClass
from scheduler.supervisor import FAILS, GOES_ON, SUCCEEDS, Group, unit_exit

SINGLE = JobShape.training(2)
MULTI = JobShape.training(1, 3)
# A group: a primary trainer on node 0 with a server beside it, a reward service on a VM
# of its own (node 1, not primary).
GROUP = JobShape.of_group(
    GroupSpec(
        roles=(
            Role("trainer", gpus=1, primary=True),
            Role("server", gpus=1),
            Role("reward", gpus=1, own_vm=True),
        )
    )
)
SHAPES = {"single": SINGLE, "multi": MULTI, "group": GROUP}

STOPS = (FailureReason.HUNG, FailureReason.STARTUP_TIMEOUT, FailureReason.GPU_FAILED)
EXIT_FAILURES = tuple(
    r
    for r in FailureReason
    if r not in STOPS
    and r not in (FailureReason.NODE_LOST, FailureReason.VM_REMOVED, FailureReason.LAUNCH_FAILED)
) + (FailureReason.LAUNCH_FAILED,)


def test_the_group_shape_has_a_service_only_rank() -> None:
    assert GROUP.kind is JobKind.GROUP and GROUP.nodes == 2
    assert GROUP.primary_ranks == frozenset({0})


@pytest.mark.parametrize("kind", SHAPES)
def test_the_last_primary_rank_exiting_0_succeeds_and_only_services_are_left(kind: str) -> None:
    shape = SHAPES[kind]
    last = max(shape.primary_ranks)
    codes = {r: (0 if r in shape.primary_ranks and r != last else None) for r in range(shape.nodes)}
    end = decide(shape, RankEnd(How.EXITED, "exit 0", rank=last, exit_code=0), codes)
    assert end.outcome is Outcome.SUCCEEDS and end.to is JobStatus.COMPLETED
    assert (end.failure, end.retry, end.counted, end.exit_code) == (None, None, None, 0)
    assert end.ended == shape.primary_ranks
    assert end.leftover == "group_done"


@pytest.mark.parametrize("kind", ["multi"])
def test_a_primary_rank_exiting_0_before_the_others_goes_on(kind: str) -> None:
    end = decide(SHAPES[kind], RankEnd(How.EXITED, "exit 0", rank=1, exit_code=0), {})
    assert end.outcome is Outcome.GOES_ON and end.to is None


def test_a_service_rank_exiting_0_while_the_primary_runs_fails_the_group() -> None:
    """The supervisor's rule for a service role that exits 0 early, one level up."""
    end = decide(GROUP, RankEnd(How.EXITED, "exit 0", rank=1, exit_code=0), {0: None})
    assert end.outcome is Outcome.FAILS and end.failure is FailureReason.EXIT_NONZERO
    assert end.counted and end.ended == frozenset({1}) and end.leftover == "rank_failed"


@pytest.mark.parametrize(("kind", "reason"), list(itertools.product(SHAPES, EXIT_FAILURES)))
def test_a_rank_that_exits_failed_fails_the_attempt_by_shared_fate(
    kind: str, reason: FailureReason
) -> None:
    shape = SHAPES[kind]
    for rank in range(shape.nodes):
        codes = dict.fromkeys(range(shape.nodes), 0 if rank else None)
        end = decide(
            shape, RankEnd(How.EXITED, "why", rank=rank, exit_code=3, failure=reason), codes
        )
        assert end.outcome is Outcome.FAILS and end.to is JobStatus.FAILED
        assert (end.failure, end.exit_code, end.why) == (reason, 3, "why")
        # Only the failed rank is known to have ended; every other one is left to kill.
        assert end.ended == frozenset({rank}) and end.leftover == "rank_failed"


def test_the_retry_class_of_a_failure_says_whether_it_is_counted() -> None:
    def failed(reason: FailureReason, code: int | None = None) -> End:
        return decide(SINGLE, RankEnd(How.EXITED, "x", 0, code, reason), {})

    assert failed(FailureReason.OOM, 75).retry is RetryClass.COUNTED
    assert failed(FailureReason.OOM, 75).counted is True
    assert failed(FailureReason.CONFIG_ERROR, 64).retry is RetryClass.PERMANENT
    assert failed(FailureReason.STORE_ERROR, 1).counted is False
    assert failed(FailureReason.LAUNCH_FAILED, 127).counted is False
    assert failed(FailureReason.LAUNCH_FAILED, 1).counted is True
    assert failed(FailureReason.VANISHED).exit_code is None


@pytest.mark.parametrize(
    ("kind", "how", "failure"),
    [
        *((k, How.STOPPED, r) for k in SHAPES for r in STOPS),
        *((k, How.LOST, FailureReason.NODE_LOST) for k in SHAPES),
        *((k, How.REMOVED, FailureReason.VM_REMOVED) for k in SHAPES),
        *((k, How.LAUNCH_REFUSED, FailureReason.LAUNCH_FAILED) for k in SHAPES),
    ],
)
def test_an_end_whose_process_may_run_on_fails_and_leaves_every_rank(
    kind: str, how: How, failure: FailureReason
) -> None:
    given = failure if how is How.STOPPED else None
    end = decide(SHAPES[kind], RankEnd(how, "why", rank=0, failure=given), {0: None})
    assert end.outcome is Outcome.FAILS and end.failure is failure
    assert (end.ended, end.leftover, end.exit_code) == (frozenset(), failure.value, None)
    # A launch refused without the VM's 126/127 is the job's (counted); the rest: the VM's.
    counted = failure in (
        FailureReason.HUNG,
        FailureReason.STARTUP_TIMEOUT,
        FailureReason.LAUNCH_FAILED,
    )
    assert end.counted is counted


@pytest.mark.parametrize("kind", SHAPES)
def test_an_expired_lease_requeues_and_a_cancel_cancels(kind: str) -> None:
    shape = SHAPES[kind]
    lease = decide(shape, RankEnd(How.LEASE_EXPIRED, "lease"), {})
    assert (lease.outcome, lease.to, lease.leftover) == (
        Outcome.REQUEUED,
        JobStatus.QUEUED,
        "lease_expired",
    )
    live = decide(shape, RankEnd(How.CANCELLED, "by you"), {})
    idle = decide(shape, RankEnd(How.CANCELLED, "by you", may_run=False), {})
    assert (live.to, live.leftover, idle.leftover) == (JobStatus.CANCELLED, "cancelled", None)
    assert live.failure is None and live.counted is None


def test_a_stop_without_its_reason_is_refused() -> None:
    with pytest.raises(ValueError):
        decide(SINGLE, RankEnd(How.STOPPED, "why", rank=0), {})
    with pytest.raises(ValueError):
        decide(SINGLE, RankEnd(How.EXITED, "why"), {})


# -- the supervisor's per-VM rule is the same rule -----------------------------------------

CODES = (None, 0, 1, 94, 137)


def units() -> list[tuple[bool, ...]]:
    """Every set of 1 to 3 units (primary or not), at least one primary."""
    return [
        flags
        for n in (1, 2, 3)
        for flags in itertools.product((True, False), repeat=n)
        if any(flags)
    ]


def supervisor_step(primaries: tuple[bool, ...], codes: dict[int, int], ended: int) -> str:
    """What the real supervisor does when role `ended` exits with codes[ended], the other
    roles' exits so far in `codes`: its `Group.watch`, on stand-in processes."""

    class Exited:
        def __init__(self, code: int | None) -> None:
            self.returncode = code

        def poll(self) -> int | None:
            return self.returncode

    group = Group.__new__(Group)
    group.roles = [{"name": f"r{i}", "primary": p} for i, p in enumerate(primaries)]
    group.signalled = None
    group.codes = {f"r{i}": c for i, c in codes.items() if i != ended}
    group.procs = {f"r{i}": Exited(codes.get(i)) for i in range(len(primaries))}
    group.restarts = {f"r{i}": 0 for i in range(len(primaries))}
    group.restart_due = {}
    group.note = lambda *_a, **_k: None  # type: ignore[method-assign]
    group.start_due = lambda: None  # type: ignore[method-assign]
    group.check_live = lambda: None  # type: ignore[method-assign]
    from scheduler import supervisor

    try:
        done = group.watch()
    except supervisor.Stop:
        return FAILS
    return SUCCEEDS if done else GOES_ON


def test_the_supervisor_and_the_scheduler_judge_every_exit_alike(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On every set of units (roles on one VM; ranks of an attempt), every state of the
    others (running, or exited with a code) and every exit of one: the supervisor's watch
    and `decide` agree on whether the whole goes on, succeeds or fails."""
    seen = 0
    for primaries in units():
        n = len(primaries)
        shape = JobShape(
            JobKind.GROUP,
            tuple(RankShape(i, 1, ((f"r{i}", 0),), p) for i, p in enumerate(primaries)),
        )
        for others in itertools.product(CODES, repeat=n - 1):
            for ended in range(n):
                before = [c for c in others]
                before.insert(ended, None)
                # A state the supervisor could not be in (it stops at the first failure,
                # and succeeds once every primary exited 0) is not one to compare.
                if any(c not in (None, 0) for c in before):
                    continue
                if all(before[i] == 0 for i in range(n) if primaries[i]):
                    continue
                if any(c == 0 and not primaries[i] for i, c in enumerate(before)):
                    continue
                for code in (0, 1, 94, 137):
                    codes = {i: c for i, c in enumerate(before) if c is not None}
                    codes[ended] = code
                    failure = None if code == 0 else FailureReason.EXIT_NONZERO
                    end = decide(
                        shape,
                        RankEnd(How.EXITED, "x", rank=ended, exit_code=code, failure=failure),
                        {i: c for i, c in enumerate(before)},
                    )
                    step = supervisor_step(primaries, codes, ended)
                    assert (
                        unit_exit(
                            primaries[ended],
                            code,
                            all(codes.get(i) == 0 for i in range(n) if primaries[i]),
                        )
                        == step
                    )
                    assert end.outcome.value == step, (primaries, before, ended, code)
                    seen += 1
    capsys.readouterr()
    assert seen > 100
