"""Progress-aware liveness: whether a running attempt is hung or stuck starting. Pure: no
I/O. The poller applies it (`scheduler.gpu_poller.liveness`).

A running attempt reports its training step in progress.json, which every poll reads. The
poller records the step and when it first read it, by the database's clock
(`jobs.progress_step`, `progress_changed_at`): time is never measured by comparing the
clocks of two machines. Then:

- **stuck starting** (`startup_timeout`): no progress.json has been read for the attempt
  `startup_timeout_s` seconds after its launch was confirmed (`running_at`).
  train_grpo.py writes it when training begins, after the model was downloaded and
  loaded, so that is what the longer timeout covers.
- **hung** (`hung`): the step has not changed for `hang_timeout_s` seconds and the
  attempt's GPUs on the polled VM are *quiet*: each is idle (utilization below
  `IDLE_UTILIZATION_PCT`) or draws less than `LOW_POWER_FRACTION` of its power limit (a
  collective waiting for a peer that never comes spins at 100 % utilization at low
  power). GPUs that work at full power are given `BUSY_FACTOR` times the timeout: a step
  that is slow but real is not stopped, and a GPU stuck in a kernel for that long is.
  A GPU with no reading counts as quiet: progress is the signal, the GPUs only give more
  time.

An attempt whose step changed at this poll is never stalled, whatever the clock says.
A timeout of 0 turns its check off. Only the rank that writes progress.json (rank 0) is
judged; for a multi-node job its own VM's GPUs give the GPU signal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.nvidia_smi import GpuLoad
from scheduler.states import FailureReason

IDLE_UTILIZATION_PCT = 10
"""A GPU busy less than this (%) is idle."""
LOW_POWER_FRACTION = 0.4
"""A GPU drawing less than this share of its power limit is not computing."""
BUSY_FACTOR = 2
"""How many hang timeouts a run whose GPUs compute at full power is given."""
STOP_GRACE_S = 30.0
"""Between TERM and KILL when a stalled attempt is stopped: train_grpo.py saves a
checkpoint on TERM."""


@dataclass(frozen=True)
class Watch:
    """What the database knows of a running attempt's progress, read at the sweep's start
    (ages by the database's clock)."""

    job_id: int
    attempt: int
    hang_timeout_s: int
    startup_timeout_s: int
    running_s: float | None
    """Seconds since the attempt's launch was confirmed; None: unknown."""
    step: int | None
    """The step last read of this attempt; None: none read yet."""
    unchanged_s: float | None
    """Seconds since `step` was first read; None with `step`."""


@dataclass(frozen=True)
class Stall:
    """A running attempt to stop, and why."""

    reason: FailureReason
    why: str
    gpus: tuple[str, ...] = ()
    """The UUIDs of the attempt's GPUs on the polled VM."""


def gpus_quiet(loads: Mapping[str, GpuLoad], uuids: Iterable[str]) -> bool:
    """Whether none of the GPUs `uuids` computes at full power: each idle, or drawing less
    than `LOW_POWER_FRACTION` of its limit, or with no reading."""
    for uuid in uuids:
        load = loads.get(uuid)
        if load is None:
            continue
        if load.utilization_pct is not None and load.utilization_pct < IDLE_UTILIZATION_PCT:
            continue
        if load.power_draw_w is None or not load.power_limit_w:
            if load.utilization_pct is None:
                continue  # nothing known of this GPU
            return False  # busy, and no power reading to tell a spin from real work
        if load.power_draw_w < LOW_POWER_FRACTION * load.power_limit_w:
            continue
        return False
    return True


def describe_loads(loads: Mapping[str, GpuLoad], uuids: Iterable[str]) -> str:
    """`GPUs 100 % at 80/400 W` — the GPU signal in a reason, one entry per GPU."""
    parts = []
    for uuid in uuids:
        load = loads.get(uuid)
        if load is None:
            parts.append("no reading")
            continue
        util = "?" if load.utilization_pct is None else f"{load.utilization_pct} %"
        draw = "?" if load.power_draw_w is None else f"{load.power_draw_w:.0f}"
        limit = "?" if load.power_limit_w is None else f"{load.power_limit_w:.0f}"
        parts.append(f"{util} at {draw}/{limit} W")
    return "GPUs " + ", ".join(parts) if parts else "no GPU reading"


def stall(
    watch: Watch, seen: int | None, loads: Mapping[str, GpuLoad], uuids: Iterable[str]
) -> Stall | None:
    """Whether the attempt `watch` describes is stalled, given the step this poll read
    (`seen`; None: no readable progress.json) and its GPUs' loads; None: leave it."""
    uuids = list(uuids)
    if seen is not None and seen != watch.step:
        return None  # it advanced (or reported its first step) at this poll
    if watch.step is None:
        limit = watch.startup_timeout_s
        if limit <= 0 or watch.running_s is None or watch.running_s < limit:
            return None
        return Stall(
            FailureReason.STARTUP_TIMEOUT,
            f"{FailureReason.STARTUP_TIMEOUT.value}: no progress reported"
            f" {watch.running_s:.0f}s after the launch (--startup-timeout {limit}s)",
            tuple(uuids),
        )
    limit = watch.hang_timeout_s
    if limit <= 0 or watch.unchanged_s is None or watch.unchanged_s < limit:
        return None
    quiet = gpus_quiet(loads, uuids)
    if not quiet and watch.unchanged_s < BUSY_FACTOR * limit:
        return None
    signal = describe_loads(loads, uuids)
    busy = "" if quiet else f", past {BUSY_FACTOR}x the timeout for GPUs at full power"
    return Stall(
        FailureReason.HUNG,
        f"{FailureReason.HUNG.value}: step {watch.step} unchanged for"
        f" {watch.unchanged_s:.0f}s (--hang-timeout {limit}s{busy}; {signal})",
        tuple(uuids),
    )
