"""The job state machine: every allowed move is allowed, every other move refused."""

from __future__ import annotations

import itertools

import pytest

from scheduler.states import (
    ALLOWED_MOVES,
    FINAL_STATES,
    STATE_TIMESTAMP,
    IllegalMove,
    JobStatus,
    check_move,
    is_allowed,
)

EXPECTED_MOVES = {
    ("queued", "pending"),
    ("queued", "starting"),
    ("queued", "completed"),
    ("queued", "failed"),
    ("queued", "cancelled"),
    ("pending", "queued"),
    ("pending", "starting"),
    ("pending", "completed"),
    ("pending", "failed"),
    ("pending", "cancelled"),
    ("starting", "running"),
    ("starting", "queued"),
    ("starting", "completed"),
    ("starting", "failed"),
    ("starting", "cancelled"),
    ("running", "completed"),
    ("running", "failed"),
    ("running", "cancelled"),
    ("failed", "queued"),
    ("failed", "completed"),
    ("failed", "cancelled"),
}
ALL_PAIRS = list(itertools.product([s.value for s in JobStatus], repeat=2))


@pytest.mark.parametrize(("src", "dst"), sorted(EXPECTED_MOVES))
def test_allowed_move_is_allowed(src: str, dst: str) -> None:
    check_move(JobStatus(src), JobStatus(dst))
    assert is_allowed(JobStatus(src), JobStatus(dst))


@pytest.mark.parametrize(("src", "dst"), sorted(set(ALL_PAIRS) - EXPECTED_MOVES))
def test_every_other_move_is_refused(src: str, dst: str) -> None:
    assert not is_allowed(JobStatus(src), JobStatus(dst))
    with pytest.raises(IllegalMove, match=f"from {src} to {dst}"):
        check_move(JobStatus(src), JobStatus(dst))


def test_the_table_is_exactly_the_documented_one() -> None:
    table = {(s.value, d.value) for s, dsts in ALLOWED_MOVES.items() for d in dsts}
    assert table == EXPECTED_MOVES


def test_final_states_have_no_way_out_and_failed_is_not_final() -> None:
    for state in FINAL_STATES:
        assert not ALLOWED_MOVES[state]
        assert state.is_final
    assert not JobStatus.FAILED.is_final
    assert JobStatus.RUNNING.is_live and not JobStatus.QUEUED.is_live


def test_every_state_stamps_a_timestamp_column() -> None:
    assert set(STATE_TIMESTAMP) == set(JobStatus)
