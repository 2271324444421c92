"""When an attempt has succeeded: the one rule, used by the poller for a live attempt and
by the leftover sweep for an attempt given up for lost that turns out to have finished.

An attempt has succeeded once every primary rank of its shape has exited 0. Ranks that are
not primary (a group's VMs running services only) do not count: they are stopped, not
expected to exit 0. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.attempts.shape import JobShape


def succeeded(shape: JobShape, exit_codes: Mapping[int, int | None]) -> bool:
    """Whether an attempt of a job of `shape` has succeeded, given the exit code known for
    each of its ranks (None, or no entry: not exited, or not known)."""
    return all(exit_codes.get(rank) == 0 for rank in shape.primary_ranks)
