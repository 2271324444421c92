"""Claim-time rules: the one place a rule that may refuse a job its GPUs is written.

A rule (`ClaimRule`) is registered once (`register`, or `registered` for a test) and is
then honoured by every claim of every kind — a single-node job, a multi-node job, a group on
one VM, a group over several VMs (`claims.batch.claim_batch_in_session` gates each queued
job before its claim) — and by the pending planner (`requeue_steps.wake_pending`: a job a
rule refuses is not woken, and waits `pending` with the rule's words).

A rule has three parts:
- `load(conn, jobs)`: what it needs, read once per batch inside the claim's transaction (or
  the planner's); it may lock (an advisory transaction lock, say) so that two dispatchers
  cannot both let through what only one may have. No network I/O: the transaction is open.
- `check(state, job, shape)`: pure; None lets the job claim, a string refuses it and is the
  pending reason (`job list` shows it: one line, bounded, sanitized here).
- `claimed(state, job, shape)`: a job of the batch was just given its GPUs (or, in the
  planner, woken to take them): later jobs of the same batch must see them taken.

`job` is the job row with at least `RULE_COLUMNS` (the claim reads `CLAIM_COLUMNS`, a
superset); `shape` is its `attempts.shape.JobShape` (GPUs per rank: `shape.gpus`,
`shape.demands`). Quotas and owners (issue 31) and priorities (issue 32) are rules here:
a built-in rule is defined in this module and registered at its import, so that the
dispatcher (through `claims.batch`) and the requeue manager (through `wake_pending`) both
honour it. A rule whose `check` raises refuses that job only, saying so; nothing a rule
says reaches `job list` but one clean line (`clean_reason`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncConnection

from scheduler.attempts.shape import JobShape
from scheduler.logging import get_logger
from scheduler.models import Job

log = get_logger("claims")

RULE_COLUMNS = (
    Job.id,
    Job.name,
    Job.status,
    Job.priority,
    Job.nodes,
    Job.gpus_requested,
    Job.roles,
)
"""The job row's columns a rule may read (the claim's `CLAIM_COLUMNS` and the pending
planner's query hold every one). A rule that needs another adds it here."""

MAX_REASON = 300
"""The most characters of a rule's reason kept (a pending reason is at most 500)."""


class ClaimRule(Protocol):
    """A rule checked at claim time (see the module's docstring)."""

    name: str

    async def load(self, conn: AsyncConnection, jobs: Sequence[Any]) -> Any:
        """What `check` needs for these jobs, read in the caller's transaction."""

    def check(self, state: Any, job: Any, shape: JobShape) -> str | None:
        """None: `job` may claim; else why it waits."""

    def claimed(self, state: Any, job: Any, shape: JobShape) -> None:
        """`job` was just given its GPUs: count them in `state`."""


class Rule:
    """A base for rules that need no state or no bookkeeping: override what you need."""

    name = "rule"

    async def load(self, conn: AsyncConnection, jobs: Sequence[Any]) -> Any:
        """No state."""
        return None

    def check(self, state: Any, job: Any, shape: JobShape) -> str | None:
        """Every job may claim."""
        return None

    def claimed(self, state: Any, job: Any, shape: JobShape) -> None:
        """Nothing to count."""


_RULES: list[ClaimRule] = []


def register(rule: ClaimRule) -> ClaimRule:
    """Honour `rule` in every claim and in the pending planner of this process (once)."""
    if not any(r is rule for r in _RULES):
        _RULES.append(rule)
    return rule


def unregister(rule: ClaimRule) -> None:
    """Stop honouring `rule` (no error if it was not registered)."""
    _RULES[:] = [r for r in _RULES if r is not rule]


def registered_rules() -> tuple[ClaimRule, ...]:
    """The rules honoured now, in the order they were registered."""
    return tuple(_RULES)


@contextmanager
def registered(*rules: ClaimRule) -> Iterator[None]:
    """`register` these rules for the block only (tests)."""
    for rule in rules:
        register(rule)
    try:
        yield
    finally:
        for rule in rules:
            unregister(rule)


def clean_reason(text: object, limit: int = MAX_REASON) -> str:
    """A reason fit for `job list`: one line, printable characters only, at most `limit`."""
    words = "".join(c if c.isprintable() else " " for c in str(text))
    words = " ".join(words.split())
    return words if len(words) <= limit else words[: limit - 1] + "…"


@dataclass
class ClaimGate:
    """The registered rules' states for one batch of job rows (by id): asks each rule
    whether a job may claim, and tells each rule what was claimed."""

    rows: dict[int, Any] = field(default_factory=dict)
    states: list[tuple[ClaimRule, Any]] = field(default_factory=list)
    shapes: dict[int, JobShape] = field(default_factory=dict)

    @classmethod
    async def load(cls, conn: AsyncConnection, jobs: Iterable[Any]) -> ClaimGate:
        """Load every registered rule for `jobs` (no query at all when none is)."""
        rules = registered_rules()
        rows = list(jobs)
        if not rules or not rows:
            return cls()
        states = [(rule, await rule.load(conn, rows)) for rule in rules]
        return cls({row.id: row for row in rows}, states)

    def _shape(self, job_id: int) -> JobShape:
        if job_id not in self.shapes:
            self.shapes[job_id] = JobShape.of_row(self.rows[job_id])
        return self.shapes[job_id]

    def refusal(self, job_id: int) -> str | None:
        """Why the first rule that refuses job `job_id` does (None: every rule allows it,
        or the job is not one of the batch's)."""
        row = self.rows.get(job_id)
        if row is None:
            return None
        for rule, state in self.states:
            try:
                reason = rule.check(state, row, self._shape(job_id))
            except Exception as exc:  # noqa: BLE001 - a rule's bug costs its job, not the batch
                log.warning("claim_rule_failed", rule=clean_reason(rule.name), job_id=job_id)
                reason = f"rule {rule.name} could not check this job ({type(exc).__name__})"
            if reason is not None:
                return clean_reason(reason) or f"refused by rule {clean_reason(rule.name)}"
        return None

    def took(self, job_id: int) -> None:
        """Job `job_id` was given its GPUs: every rule counts them."""
        row = self.rows.get(job_id)
        if row is None:
            return
        for rule, state in self.states:
            rule.claimed(state, row, self._shape(job_id))
