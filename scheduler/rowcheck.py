"""What a stored job row must be before the scheduler launches it: every value read from
`jobs` (possibly written by hand, or by an older rlfleet) is checked here, and a row that
fails fails its own job once with the reason (docs/security.md). Apart from `validate`
(the limits and value checks, a leaf of the import graph) because it reads the job's shape
(`attempts.shape`: its roles, and how its GPUs fall on its VMs), which itself relies on
`validate`."""

from __future__ import annotations

from typing import Any

from scheduler.attempts.shape import JobShape
from scheduler.validate import (
    DIGEST_RE,
    INT4,
    MAX_JOB_GPUS,
    MAX_NODES,
    MAX_RETRIES,
    UnreadableJson,
    env_problem,
    extra_args_problem,
    json_kind,
    utf8_problem,
)

ROW_COUNTS: tuple[tuple[str, int, int], ...] = (
    # The scheduler adds one to each: the largest value must leave room for it.
    ("attempt", 0, INT4[1] - 1),
    ("retry_count", 0, INT4[1] - 1),
    ("machine_faults", 0, INT4[1] - 1),
    ("max_retries", 0, MAX_RETRIES),
    ("nodes", 1, MAX_NODES),
)
"""A job row's counters and their ranges (`job_row_problem`)."""


def job_row_problem(row: Any) -> str | None:
    """Why a job row (from `jobs`, possibly written by hand) cannot be launched, or None.

    Checks what the launch relies on: `extra_args` a JSON array of strings, `env` an object
    of strings a job may set, its shape (`roles` a group spec, or a training job's GPUs the
    same on each of its VMs), a GPU count and counters in range
    (`ROW_COUNTS`: an attempt at the integer limit would overflow at the claim), non-empty
    model, dataset and reward functions. A JSON column too deep to decode reads as an
    `UnreadableJson` (`bounded_json_loads`) and is refused here."""
    gpus = row.gpus_requested
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_JOB_GPUS:
        return f"gpus_requested must be between 1 and {MAX_JOB_GPUS}, not {gpus!r}"
    for field, low, high in ROW_COUNTS:
        value = getattr(row, field, low)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"{field} must be between {low} and {high}, not {value!r}"
    for field in ("model", "dataset", "reward_function"):
        value = getattr(row, field)
        if not isinstance(value, str) or not value.strip():
            return f"{field} is empty"
        problem = utf8_problem(value)
        if problem:
            return f"{field} {problem}"
    if not all(r.strip() for r in row.reward_function.split(",")):
        return "reward_function has an empty name"
    problem = env_problem(getattr(row, "env", {}))
    if problem:
        return problem
    digest = getattr(row, "workdir_digest", None)
    if digest is not None and not (isinstance(digest, str) and DIGEST_RE.fullmatch(digest)):
        return f"workdir_digest is not a sha256 digest: {digest!r}"[:200]
    store = getattr(row, "store", None)
    if store is not None:
        from scheduler.store import parse_store_url

        try:
            parse_store_url(store)
        except ValueError as exc:
            return f"store: {exc}"
    problem = roles_problem(getattr(row, "roles", None), gpus, getattr(row, "nodes", 1))
    if problem is not None:
        return problem
    extra = row.extra_args
    if isinstance(extra, UnreadableJson):
        return f"extra_args: {extra.problem}"
    if not isinstance(extra, list):
        return f"extra_args must be a JSON array of strings, not a JSON {json_kind(extra)}"
    problem = extra_args_problem(extra)
    return f"extra_args: {problem}" if problem else None


def roles_problem(roles: Any, gpus: int, nodes: Any = 1) -> str | None:
    """Why a job row's shape cannot be launched, or None (`JobShape.problem`): a group's
    `roles` must read back as a valid spec laid out on `nodes` VMs (`GroupSpec.layout`)
    whose GPUs together are `gpus`; a training job's (`roles` None) `gpus` must be the same
    on each of its VMs."""
    return JobShape.of(nodes, roles, gpus).problem
