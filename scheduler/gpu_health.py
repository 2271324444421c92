"""Per-GPU health: what one poll's reading of a GPU means for it (pure, no I/O).

A GPU is unhealthy, with a one-line reason, while any of these holds (docs/gpu-health.md):

- it is lost: a GPU the VM had is missing from nvidia-smi's listing;
- it reports a fault: `[GPU requires reset]`, `[Unknown Error]` or `ERR!` in a field;
- its uncorrected volatile ECC count rose above the count it had while healthy;
- a page retirement or a row remapping is pending (it waits for a reset).

Fields a GPU or driver does not support (`[N/A]`, `[Not Supported]`) are unknown, never
a sign of trouble. Once unhealthy, a GPU is healthy again only after the condition has
been clear for `CLEAR_POLLS` polls in a row (a reset or a reboot clears it: the volatile
ECC count starts again from 0, pending retirements and remappings are done).

A lost GPU or one that reports a fault cannot be computed on (`stops_attempt`): the poller
stops the attempt there and retries its job elsewhere as a machine fault. Rising ECC or a
pending retirement or remapping only keeps new jobs off it: an attempt there is left to
finish unless it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.nvidia_smi import GpuInfo

CLEAR_POLLS = 3
"""Polls in a row in which an unhealthy GPU's condition must be clear before it is healthy
again (with the default 5 s poll interval, 15 s)."""

LOST = "lost"
FAULT = "fault"
ECC = "ecc"
RETIRED = "retired_pages"
REMAPPED = "remapped_rows"
STOPPING_KINDS = frozenset({LOST, FAULT})
"""Conditions under which an attempt on the GPU is stopped."""


@dataclass(frozen=True)
class Condition:
    """What is wrong with a GPU in one poll."""

    kind: str
    reason: str
    """One line, shown by `vm show`, `vm list --json`, the fleet page and the metrics."""

    @property
    def stops_attempt(self) -> bool:
        """Whether an attempt on the GPU must be stopped (the GPU cannot compute)."""
        return self.kind in STOPPING_KINDS


@dataclass(frozen=True)
class Health:
    """A GPU's stored health (`gpus` columns)."""

    reason: str | None = None
    """Why it is unhealthy; None: healthy."""
    clear_polls: int = 0
    """Polls in a row since its condition cleared (while `reason` is set)."""
    ecc_baseline: int | None = None
    """The uncorrected volatile ECC count it had while healthy; a count above it is rising."""

    @property
    def healthy(self) -> bool:
        return self.reason is None


def condition(reading: GpuInfo | None, baseline: int | None) -> Condition | None:
    """What is wrong with a GPU given this poll's `reading` (None: not listed) and its
    ECC baseline; None when nothing is."""
    if reading is None:
        return Condition(LOST, "lost: no longer listed by nvidia-smi")
    if reading.fault is not None:
        what = "requires reset" if "reset" in reading.fault.lower() else "reports an error"
        return Condition(FAULT, f"{what}: nvidia-smi prints {reading.fault}")
    count = reading.ecc_uncorrected
    if count is not None and baseline is not None and count > baseline:
        return Condition(ECC, f"uncorrected ECC errors rose from {baseline} to {count}")
    if reading.retired_pending:
        return Condition(RETIRED, "page retirement pending (needs a GPU reset)")
    if reading.remapped_pending:
        return Condition(REMAPPED, "row remapping pending (needs a GPU reset)")
    return None


@dataclass(frozen=True)
class Step:
    """A GPU's health after one poll."""

    health: Health
    condition: Condition | None
    """What this poll found wrong; None: nothing."""
    event: str | None = None
    """The event to record when its health changed: the new reason, or `healthy` text."""


def step(before: Health, reading: GpuInfo | None, *, clear_polls: int = CLEAR_POLLS) -> Step:
    """The health after one poll: unhealthy at once on a condition; healthy again only
    once `clear_polls` polls in a row found none."""
    found = condition(reading, before.ecc_baseline)
    count = reading.ecc_uncorrected if reading is not None else None
    if found is not None:
        # The baseline stays what it was while healthy: a reset bringing the count back
        # to it (or below) is what clears the condition.
        after = Health(found.reason, 0, before.ecc_baseline)
        event = found.reason if found.reason != before.reason else None
        return Step(after, found, event)
    baseline = count if count is not None else before.ecc_baseline
    if before.healthy:
        return Step(Health(None, 0, baseline), None)
    cleared = before.clear_polls + 1
    if cleared >= clear_polls:
        return Step(
            Health(None, 0, baseline),
            None,
            f"healthy again: clear for {cleared} polls (was: {before.reason})",
        )
    # Still unhealthy while clearing; a count that went down (a reset) is the new baseline.
    keep = (
        before.ecc_baseline
        if count is None or before.ecc_baseline is None
        else min(count, before.ecc_baseline)
    )
    return Step(Health(before.reason, cleared, keep), None)
