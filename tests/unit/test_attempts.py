"""The placed attempt's pure parts: a job's shape (which ranks are primary) and the one
outcome rule every finisher uses (the poller for a live attempt, the leftover sweep for a
late success)."""

from __future__ import annotations

import sys

import pytest

from scheduler.attempts.outcome import succeeded
from scheduler.attempts.shape import JobShape
from scheduler.jobspec import parse_data


def spread_group() -> dict[str, object]:
    """A reward server on a VM of its own (rank 1) and a trainer (rank 0)."""
    return parse_data(
        {
            "roles": {
                "reward": {"command": [sys.executable, "-c", "pass"], "own_vm": True},
                "trainer": {
                    "command": [sys.executable, "-c", "pass"],
                    "gpus": 1,
                    "primary": True,
                },
            }
        }
    ).to_data()


def test_a_job_that_is_not_a_group_counts_every_rank() -> None:
    assert JobShape.of(1, None) == JobShape.training(1, 1)
    assert JobShape.of(3, None).primary_ranks == frozenset({0, 1, 2})
    assert JobShape.of(3, None, 6).demands == (2, 2, 2)


def test_a_group_over_two_vms_counts_the_vm_of_its_primary_role_only() -> None:
    shape = JobShape.of(2, spread_group())
    assert shape.group and shape.nodes == 2
    assert shape.primary_ranks == frozenset({0})


def test_roles_that_do_not_read_back_count_every_rank() -> None:
    """A row edited since its claim: no rank is skipped (the safe reading)."""
    shape = JobShape.of(2, {"roles": "nonsense"})
    assert shape.group and shape.primary_ranks == frozenset({0, 1})
    deep: object = []
    for _ in range(5000):
        deep = [deep]
    assert JobShape.of(2, {"roles": deep}).primary_ranks == frozenset({0, 1})


@pytest.mark.parametrize(
    ("nodes", "roles", "codes", "expected"),
    [
        (1, None, {0: 0}, True),  # one VM, exited 0
        (1, None, {0: 1}, False),
        (1, None, {}, False),  # not known to have exited
        (2, None, {0: 0, 1: 0}, True),  # every rank of a multi-node job
        (2, None, {0: 0, 1: None}, False),
        (2, None, {0: 0, 1: 137}, False),
        (2, "spread", {0: 0, 1: None}, True),  # the server's rank was killed: not counted
        (2, "spread", {0: 0, 1: 137}, True),
        (2, "spread", {0: None, 1: 0}, False),  # the trainer has not exited
        (2, "spread", {0: 1, 1: 0}, False),
    ],
)
def test_one_rule_says_when_an_attempt_of_any_kind_succeeded(
    nodes: int, roles: str | None, codes: dict[int, int | None], expected: bool
) -> None:
    shape = JobShape.of(nodes, spread_group() if roles == "spread" else None)
    assert succeeded(shape, codes) is expected


def test_a_nodes_count_out_of_range_is_bounded_as_a_claim_bounds_it() -> None:
    """A row edited after its claim (nodes 2^31-1, 0, not an integer) costs the poll no
    more than the largest job a claim allows."""
    from scheduler.validate import MAX_NODES

    assert JobShape.of(2**31 - 1, None).nodes == MAX_NODES
    assert JobShape.of(0, None).ranks == JobShape.training(1, 1).ranks
    assert JobShape.of(0, None).problem == "nodes must be between 1 and 64, not 0"
    assert JobShape.of("3", None).ranks == JobShape.training(1, 1).ranks
    assert JobShape.of(1, None, 10**9).problem is not None
