"""The retry policy: given a failed attempt, retry it (when) or give up (why). No I/O.

Rules, as users of Slurm and SkyPilot would expect them:

- `config_error` (train_grpo.py exit 64) and `cancelled` are permanent: never retried.
- `oom`, `transient`, `exit_nonzero`, `killed`, `launch_failed`, `vanished` (and a failure with no
  recorded reason) are retried while `retry_count < max_retries`, after an exponential
  backoff with jitter: `base * factor**retry_count`, capped at `max_delay`, then scaled by
  a random factor in `[1 - jitter, 1 + jitter]` so that a burst of failures (a flaky hub,
  a crashed node) does not come back as one burst.
- `node_lost` (the VM stopped answering) is the machine's fault, not the job's: like
  Slurm's requeue on node failure it does NOT count against `max_retries` and is retried
  almost at once (elsewhere: the lost VM is unreachable, so no dispatcher picks it). It
  has its own generous cap, `node_lost_limit`, so that a job that kills every node it
  lands on still ends. Two more machine faults are treated the same way, sharing that
  cap: `vm_removed` (the operator removed the VM with `--force` while the job ran) and
  `launch_failed` with exit 126/127 (the VM's python or entrypoint cannot run; the poller
  keeps that VM out of use until they work).
- `store_error` (the job's store could not be reached or refused when an attempt
  started) is an outage, most often the store's for every job: it does not count against
  `max_retries` and is retried with the same exponential backoff, its exponent the
  number of uncounted retries so far (`attempt - 1 - retry_count`). So is
  `download_failed` (train_grpo.py exited 75 because a hub download failed: the hub's
  outage, or the VM's network, not the job's fault).
- Every retry that does not count (the machine faults and the outages) is counted per
  job and class in `jobs.uncounted_retries`; their sum is capped by `uncounted_limit`
  (20 by default): past it the job fails for good, "gave up after 20 uncounted retries
  (store_error ×12, node_lost ×8): last: …". So no class a job can bring about itself (a
  store it makes fail, a VM it makes lose contact) retries it without end.

`decide` is what the requeue manager calls when it first sees a failed job; the answer is
stored on the job (`retry_decision`: `retry` at `next_attempt_at`, or `give_up` with a
`status_reason` starting with "gave up"). The machine faults it caps are counted in the
job's `machine_faults` column, by `jobs.transition` as the failure is recorded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from scheduler.states import FAILURE_RETRY, FailureReason, RetryClass

CANCELLED = "cancelled"
"""Not a `FailureReason` (cancelled is a state of its own) but never retried either."""

PERMANENT = frozenset(
    {r.value for r, c in FAILURE_RETRY.items() if c == RetryClass.PERMANENT} | {CANCELLED}
)
COUNTED = frozenset(
    r.value
    for r, c in FAILURE_RETRY.items()
    if c in (RetryClass.COUNTED, RetryClass.MACHINE_FAULT_ON_VM_EXIT)
)
VM_FAULT_EXITS = frozenset({126, 127})
"""Exit codes of an attempt whose VM could not run its python or entrypoint."""
GIVE_UP_PREFIX = "gave up"
"""Every give-up reason starts with this (the status_reason users read; the decision
itself is stored in `jobs.retry_decision`)."""


class RetryableJob(Protocol):
    """What the policy reads from a job (a `scheduler.models.Job` row fits)."""

    retry_count: int
    max_retries: int
    attempt: int


@dataclass(frozen=True)
class Failure:
    """One failed attempt: why, with which exit code, and how many node losses so far."""

    reason: str | None
    exit_code: int | None = None
    node_lost_count: int = 0
    """Machine faults of this job including this one (`is_machine_fault`): the VM lost,
    removed, or unable to start training."""
    uncounted: object = None
    """The job's uncounted retries so far by class (`jobs.uncounted_retries`, read from a
    row: checked by `uncounted_counts` before use)."""

    def describe(self) -> str:
        """`exit_nonzero (exit 1)`, `oom (exit 75)`, `node_lost`…"""
        text = self.reason or "unknown failure"
        return f"{text} (exit {self.exit_code})" if self.exit_code is not None else text


@dataclass(frozen=True)
class Retry:
    """Retry the job at `at`. `counts` says whether it uses up one of its `max_retries`."""

    at: datetime
    counts: bool = True


@dataclass(frozen=True)
class GiveUp:
    """Leave the job failed; `why` is its status_reason, e.g. "gave up after 3 retries: …"."""

    why: str


@dataclass(frozen=True)
class RetryPolicy:
    """The knobs of the backoff. The defaults suit real training jobs."""

    base_delay_s: float = 10.0
    factor: float = 2.0
    max_delay_s: float = 600.0
    jitter: float = 0.25
    """Relative: 0.25 means the delay is scaled by a random factor in [0.75, 1.25]."""
    node_lost_delay_s: float = 0.0
    node_lost_limit: int = 10
    uncounted_limit: int = 20
    """Most retries per job that do not count against `max_retries`, all classes together
    (machine faults and outages): it was `outage_limit` (300, outages only)."""

    def backoff(self, retry_count: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `retry_count + 1`, jitter included."""
        # The exponent is bounded: a count read from a row may be any integer a column holds,
        # and a float power past ~1e308 raises OverflowError (the delay is capped anyway).
        exponent = min(max(0, retry_count), 64)
        raw = min(self.max_delay_s, self.base_delay_s * self.factor**exponent)
        return max(0.0, raw * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter))


DEFAULT_POLICY = RetryPolicy()


def decide(
    job: RetryableJob,
    failure: Failure,
    now: datetime,
    rng: random.Random,
    policy: RetryPolicy = DEFAULT_POLICY,
) -> Retry | GiveUp:
    """Whether and when to retry `job` after `failure`, seen at `now`."""
    reason = failure.reason
    if reason in PERMANENT:
        return GiveUp(f"{GIVE_UP_PREFIX}: {failure.describe()} is permanent, not retried")
    uncounted = not counts_against_limit(reason, failure.exit_code)
    counts = uncounted_counts(failure.uncounted)
    if uncounted and sum(counts.values()) >= policy.uncounted_limit:
        return GiveUp(uncounted_give_up(counts, failure, policy.uncounted_limit))
    if is_machine_fault(reason, failure.exit_code):
        if failure.node_lost_count > policy.node_lost_limit:
            what = "lost nodes" if reason == FailureReason.NODE_LOST.value else "VM failures"
            return GiveUp(
                f"{GIVE_UP_PREFIX} after {failure.node_lost_count} {what}: "
                f"{failure.describe()} (limit {policy.node_lost_limit})"
            )
        return Retry(at=now + timedelta(seconds=policy.node_lost_delay_s), counts=False)
    if is_outage(reason):
        so_far = max(0, job.attempt - 1 - job.retry_count)
        return Retry(at=now + timedelta(seconds=policy.backoff(so_far, rng)), counts=False)
    # Counted reasons, and anything unknown: a new reason must not make jobs immortal.
    if job.retry_count >= job.max_retries:
        plural = "retry" if job.retry_count == 1 else "retries"
        return GiveUp(f"{GIVE_UP_PREFIX} after {job.retry_count} {plural}: {failure.describe()}")
    return Retry(at=now + timedelta(seconds=policy.backoff(job.retry_count, rng)))


MAX_COUNT = 2**31 - 1


def uncounted_counts(raw: object) -> dict[str, int]:
    """A job's `uncounted_retries` as read from its row (possibly written by hand): the
    classes named by a short string with a count above 0 (at most `MAX_COUNT`); anything
    else is left out. Never raises."""
    if not isinstance(raw, dict):
        return {}
    counts: dict[str, int] = {}
    for key, value in list(raw.items())[:64]:
        if not isinstance(key, str) or not 0 < len(key) <= 32:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        counts[key] = min(value, MAX_COUNT)
    return counts


def add_uncounted(raw: object, reason: str | None) -> dict[str, int]:
    """`raw` (a row's `uncounted_retries`) with one more retry after `reason`."""
    counts = uncounted_counts(raw)
    key = reason if reason and len(reason) <= 32 else "unknown"
    counts[key] = min(counts.get(key, 0) + 1, MAX_COUNT)
    return counts


def uncounted_give_up(counts: dict[str, int], failure: Failure, limit: int) -> str:
    """`gave up after 20 uncounted retries (store_error ×12, node_lost ×8): last: …`."""
    order = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    tally = ", ".join(f"{reason} ×{count}" for reason, count in order)
    return (
        f"{GIVE_UP_PREFIX} after {sum(counts.values())} uncounted retries ({tally}):"
        f" last: {failure.describe()} (limit {limit})"
    )


def is_machine_fault(reason: str | None, exit_code: int | None = None) -> bool:
    """Whether a failure is the VM's fault, not the job's: a lost or removed VM, or one that
    could not run its python or entrypoint (exit 126/127)."""
    try:
        kind = FAILURE_RETRY[FailureReason(reason)] if reason is not None else None
    except ValueError:  # a reason this release does not know: the job's, counted
        return False
    if kind == RetryClass.MACHINE_FAULT:
        return True
    return kind == RetryClass.MACHINE_FAULT_ON_VM_EXIT and exit_code in VM_FAULT_EXITS


def is_outage(reason: str | None) -> bool:
    """Whether a failure is an outage of a service the job needs (`store_error`, the hub's
    `download_failed`)."""
    try:
        return reason is not None and FAILURE_RETRY[FailureReason(reason)] == RetryClass.OUTAGE
    except ValueError:
        return False


def counts_against_limit(reason: str | None, exit_code: int | None = None) -> bool:
    """Whether a retry after a failure for `reason` uses up one of the job's `max_retries`."""
    return not is_machine_fault(reason, exit_code) and not is_outage(reason)
