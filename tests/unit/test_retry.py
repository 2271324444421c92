"""The retry policy, as a table: which failures come back, when, and when we give up."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from scheduler.retry import (
    GIVE_UP_PREFIX,
    Failure,
    GiveUp,
    Retry,
    RetryPolicy,
    counts_against_limit,
    decide,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
NO_JITTER = RetryPolicy(base_delay_s=10, factor=2, max_delay_s=600, jitter=0.0, node_lost_limit=5)


@dataclass
class J:
    """A job as the policy sees it."""

    retry_count: int = 0
    max_retries: int = 3


@pytest.mark.parametrize(
    ("retry_count", "max_retries", "failure", "expected"),
    [
        # permanent reasons never come back, whatever the retries left
        (
            0,
            3,
            Failure("config_error", 64),
            "gave up: config_error (exit 64) is permanent, not retried",
        ),
        (0, 3, Failure("cancelled"), "gave up: cancelled is permanent, not retried"),
        # counted reasons come back while retries are left, with exponential backoff
        (0, 3, Failure("oom", 75), 10.0),
        (1, 3, Failure("exit_nonzero", 1), 20.0),
        (2, 3, Failure("killed", 137), 40.0),
        (0, 3, Failure("launch_failed"), 10.0),
        (0, 3, Failure("vanished"), 10.0),
        (0, 3, Failure(None), 10.0),
        (0, 3, Failure("some_future_reason", 3), 10.0),
        # ... and not once they are used up
        (3, 3, Failure("exit_nonzero", 1), "gave up after 3 retries: exit_nonzero (exit 1)"),
        (1, 1, Failure("oom", 75), "gave up after 1 retry: oom (exit 75)"),
        (0, 0, Failure("vanished"), "gave up after 0 retries: vanished"),
        (9, 3, Failure("exit_nonzero", 2), "gave up after 9 retries: exit_nonzero (exit 2)"),
        # node_lost does not use up max_retries: retried at once, even with none left
        (3, 3, Failure("node_lost", node_lost_count=1), 0.0),
        (0, 0, Failure("node_lost", node_lost_count=5), 0.0),
        # ... but a job that loses every node it lands on still ends
        (
            0,
            3,
            Failure("node_lost", node_lost_count=6),
            "gave up after 6 lost nodes: node_lost (limit 5)",
        ),
    ],
)
def test_decide_table(
    retry_count: int, max_retries: int, failure: Failure, expected: float | str
) -> None:
    """Given a job and a failed attempt, the policy retries after the delay or gives up."""
    decision = decide(J(retry_count, max_retries), failure, NOW, random.Random(0), NO_JITTER)
    if isinstance(expected, str):
        assert decision == GiveUp(expected)
        assert decision.why.startswith(GIVE_UP_PREFIX)
    else:
        assert isinstance(decision, Retry)
        assert decision.at == NOW + timedelta(seconds=expected)
        assert decision.counts is counts_against_limit(failure.reason)


def test_backoff_is_capped() -> None:
    """However many retries a job has had, the wait never exceeds the cap."""
    policy = RetryPolicy(base_delay_s=10, factor=2, max_delay_s=60, jitter=0.0)
    decision = decide(J(10, 100), Failure("oom", 75), NOW, random.Random(0), policy)
    assert decision == Retry(at=NOW + timedelta(seconds=60))


def test_jitter_spreads_retries_within_bounds() -> None:
    """Given many jobs failing at the same moment, their retries are spread, not a burst."""
    policy = RetryPolicy(base_delay_s=100, factor=2, max_delay_s=1000, jitter=0.25)
    rng = random.Random(42)
    delays = []
    for _ in range(200):
        decision = decide(J(0, 3), Failure("exit_nonzero", 1), NOW, rng, policy)
        assert isinstance(decision, Retry)
        delays.append((decision.at - NOW).total_seconds())
    assert all(75.0 <= d <= 125.0 for d in delays)
    assert len({round(d, 3) for d in delays}) > 150
    assert min(delays) < 85 and max(delays) > 115


def test_same_seed_same_decision() -> None:
    """The policy is pure: the same inputs and random state give the same answer."""
    a = decide(J(1, 3), Failure("oom", 75), NOW, random.Random(7))
    b = decide(J(1, 3), Failure("oom", 75), NOW, random.Random(7))
    assert a == b


def test_failure_description() -> None:
    """Reasons read well in `job show`, with the exit code when there is one."""
    assert Failure("exit_nonzero", 1).describe() == "exit_nonzero (exit 1)"
    assert Failure("node_lost").describe() == "node_lost"
    assert Failure(None).describe() == "unknown failure"


@pytest.mark.parametrize(
    ("reason", "exit_code", "counted"),
    [
        ("node_lost", None, False),
        ("vm_removed", None, False),
        ("launch_failed", 126, False),
        ("launch_failed", 127, False),
        ("launch_failed", None, True),  # the launch over SSH failed: counted as before
        ("exit_nonzero", 127, True),
    ],
)
def test_machine_faults_do_not_use_up_retries(
    reason: str, exit_code: int | None, counted: bool
) -> None:
    assert counts_against_limit(reason, exit_code) is counted
    decision = decide(
        J(retry_count=3, max_retries=3),
        Failure(reason, exit_code, 1),
        NOW,
        random.Random(0),
        NO_JITTER,
    )
    assert isinstance(decision, GiveUp if counted else Retry)
    if not counted:
        assert isinstance(decision, Retry) and not decision.counts
        capped = decide(J(), Failure(reason, exit_code, 6), NOW, random.Random(0), NO_JITTER)
        assert isinstance(capped, GiveUp)


def test_the_backoff_of_any_stored_retry_count_is_the_cap_never_an_overflow() -> None:
    """A retry count written by hand (any integer a column holds) gives the capped delay:
    `factor ** retry_count` in floats would raise OverflowError in the requeue loop."""
    policy = RetryPolicy(jitter=0.0)
    for count in (1100, 2**31 - 1):
        assert policy.backoff(count, random.Random(0)) == policy.max_delay_s


def test_every_failure_reason_has_its_retry_class() -> None:
    """A new failure reason is added in one place, with its retry class: none is missing,
    and the policy's sets and machine-fault rule follow from the table."""
    from scheduler.retry import COUNTED, PERMANENT, is_machine_fault
    from scheduler.states import FAILURE_RETRY, FailureReason, RetryClass

    assert set(FAILURE_RETRY) == set(FailureReason)
    for reason, kind in FAILURE_RETRY.items():
        assert (reason.value in PERMANENT) == (kind == RetryClass.PERMANENT)
        assert is_machine_fault(reason.value, 1) == (kind == RetryClass.MACHINE_FAULT)
        if kind == RetryClass.MACHINE_FAULT_ON_VM_EXIT:
            assert is_machine_fault(reason.value, 127) and reason.value in COUNTED
    assert not is_machine_fault("a_reason_from_a_newer_release", 127)
