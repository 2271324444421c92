"""History the poller keeps for the dashboard: progress samples per training step of each
attempt, and GPU samples per poll, pruned after a retention (`RLFLEET_HISTORY_DAYS`).

The poller writes both inside the transaction in which it already writes the poll's VM and
GPU rows (docs/invariants.md, invariant 4); the web pages read them back aggregated in SQL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler.errors import BadInput

HISTORY_DAYS_ENV = "RLFLEET_HISTORY_DAYS"
DEFAULT_HISTORY_DAYS = 7.0
MAX_HISTORY_DAYS = 3660.0
GPU_SAMPLE_EVERY_S = 15.0
"""How often the poller daemon records a VM's GPU samples (a poll every few seconds;
a timeline of an hour averages minute-wide buckets, so one sample in three polls is as
good a chart for a third of the rows)."""
PRUNE_EVERY_S = 60.0
"""How often the poller deletes samples older than the retention."""
PRUNE_BATCH = 20_000
"""Most rows of one table one prune deletes, so its transaction stays short; a backlog
goes in the next prunes."""


def history_days(env: Mapping[str, str] | None = None) -> float:
    """The retention in days: `RLFLEET_HISTORY_DAYS`, else 7. `BadInput` when not a number
    in (0, 3660]."""
    env = os.environ if env is None else env
    raw = env.get(HISTORY_DAYS_ENV, "").strip()
    if not raw:
        return DEFAULT_HISTORY_DAYS
    try:
        days = float(raw)
    except ValueError:
        raise BadInput(f"{HISTORY_DAYS_ENV}={raw[:40]!r} is not a number of days") from None
    if not 0 < days <= MAX_HISTORY_DAYS:
        raise BadInput(f"{HISTORY_DAYS_ENV} must be more than 0 and at most {MAX_HISTORY_DAYS:g}")
    return days


# --- writing (the poller) ---------------------------------------------------------------

# One statement per kind for the whole batch of polls: columns as arrays.
_PROGRESS_SQL = text(
    """
INSERT INTO progress_samples (job_id, attempt, step, reward, loss)
SELECT t.job_id, t.attempt, t.step, t.reward, t.loss
FROM unnest(CAST(:job_ids AS bigint[]), CAST(:attempts AS int[]), CAST(:steps AS int[]),
            CAST(:rewards AS float8[]), CAST(:losses AS float8[]))
    AS t(job_id, attempt, step, reward, loss)
WHERE EXISTS (SELECT 1 FROM jobs WHERE jobs.id = t.job_id)
ON CONFLICT (job_id, attempt, step) DO NOTHING
"""
)
# GPUs are named by (VM, UUID), as the poll knows them; the row's id is looked up here.
_GPU_SQL = text(
    """
INSERT INTO gpu_samples (gpu_id, utilization_pct, memory_used_mb, memory_total_mb)
SELECT g.id, t.util, t.used, t.total
FROM unnest(CAST(:vm_ids AS int[]), CAST(:uuids AS text[]), CAST(:utils AS int[]),
            CAST(:useds AS int[]), CAST(:totals AS int[]))
    AS t(vm_id, u, util, used, total)
JOIN gpus g ON g.vm_id = t.vm_id AND g.uuid = t.u
"""
)


@dataclass(frozen=True)
class ProgressRow:
    """One step of one attempt, as a poll read it."""

    job_id: int
    attempt: int
    step: int
    reward: float | None
    loss: float | None


@dataclass(frozen=True)
class GpuReading:
    """One GPU's reading in one poll."""

    vm_id: int
    uuid: str
    utilization_pct: int | None
    memory_used_mb: int | None
    memory_total_mb: int | None


async def record_samples(
    session: AsyncSession, progress: Sequence[ProgressRow], gpus: Sequence[GpuReading]
) -> None:
    """Insert the samples of a batch of polls in the caller's transaction (a step already
    recorded for an attempt is kept as first seen)."""
    if progress:
        await session.execute(
            _PROGRESS_SQL,
            {
                "job_ids": [p.job_id for p in progress],
                "attempts": [p.attempt for p in progress],
                "steps": [p.step for p in progress],
                "rewards": [p.reward for p in progress],
                "losses": [p.loss for p in progress],
            },
        )
    if gpus:
        await session.execute(
            _GPU_SQL,
            {
                "vm_ids": [g.vm_id for g in gpus],
                "uuids": [g.uuid for g in gpus],
                # SMALLINT column: nvidia-smi reports 0-100; anything else is not a reading.
                "utils": [
                    g.utilization_pct
                    if g.utilization_pct is not None and 0 <= g.utilization_pct <= 1000
                    else None
                    for g in gpus
                ],
                "useds": [g.memory_used_mb for g in gpus],
                "totals": [g.memory_total_mb for g in gpus],
            },
        )


async def prune(session: AsyncSession, days: float, *, batch: int = PRUNE_BATCH) -> int:
    """Delete samples, and GPU health events (`gpu_events`), older than `days` (at most
    `batch` rows per table); how many went."""
    deleted = 0
    for table, column in (
        ("gpu_samples", "recorded_at"),
        ("progress_samples", "recorded_at"),
        ("gpu_events", "created_at"),
    ):
        result = await session.execute(
            text(
                f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} "
                f"WHERE {column} < now() - make_interval(secs => :secs) LIMIT :batch)"
            ),
            {"secs": days * 86400.0, "batch": batch},
        )
        deleted += int(getattr(result, "rowcount", 0) or 0)
    return deleted


# --- reading (the dashboard) ------------------------------------------------------------


async def job_curve(session: AsyncSession, job_id: int) -> list[dict[str, Any]]:
    """Every recorded step of the job's attempts, in order: attempt, step, reward, loss, at."""
    rows = await session.execute(
        text(
            "SELECT attempt, step, reward, loss, recorded_at FROM progress_samples "
            "WHERE job_id = :job_id ORDER BY attempt, step"
        ),
        {"job_id": job_id},
    )
    return [
        {
            "attempt": r.attempt,
            "step": r.step,
            "reward": r.reward,
            "loss": r.loss,
            "at": r.recorded_at,
        }
        for r in rows
    ]


TIMELINE_BUCKETS = 60
"""Points of one timeline: its span is cut into this many buckets, averaged in SQL."""
MIN_TIMELINE_S = 60.0
"""The shortest span a timeline covers, so a VM polled for a few seconds is not one bucket
stretched over the page."""


@dataclass(frozen=True)
class TimelineSpan:
    """The times a page's timelines cover, in seconds since the epoch."""

    start: float
    end: float


async def timeline_span(
    session: AsyncSession, vm_ids: Sequence[int], *, hours: float
) -> TimelineSpan:
    """What the timelines of `vm_ids` cover: up to now, from the first sample of theirs in
    the last `hours` (at least `MIN_TIMELINE_S` back), so that a fleet polled for a minute
    draws that minute across the chart rather than a dot at the end of three hours."""
    seconds = max(MIN_TIMELINE_S, hours * 3600.0)
    row = (
        await session.execute(
            text(
                """
SELECT extract(epoch FROM now()) AS now,
       (SELECT extract(epoch FROM min(f.recorded_at))
        FROM gpus g
        -- The first sample of each GPU in the window: one index probe per GPU.
        CROSS JOIN LATERAL (
            SELECT s.recorded_at FROM gpu_samples s
            WHERE s.gpu_id = g.id AND s.recorded_at >= now() - make_interval(secs => :secs)
            ORDER BY s.recorded_at LIMIT 1
        ) f
        WHERE g.vm_id = ANY(CAST(:vm_ids AS int[]))) AS first
"""
            ),
            {"vm_ids": list(vm_ids), "secs": seconds},
        )
    ).one()
    end = float(row.now)
    first = end - seconds if row.first is None else max(end - seconds, float(row.first))
    return TimelineSpan(start=min(first, end - MIN_TIMELINE_S), end=end)


async def vm_timelines(
    session: AsyncSession,
    vm_ids: Sequence[int],
    *,
    hours: float,
    span: TimelineSpan | None = None,
) -> dict[int, list[dict[str, Any]]]:
    """For each VM, its GPUs' mean utilisation and memory use (percent of total) over
    `span` (by default `timeline_span` of the last `hours`), one point per bucket that has
    samples: {vm_id: [{t, util, mem}]}, `t` the bucket's middle in seconds since the
    epoch."""
    if not vm_ids:
        return {}
    if span is None:
        span = await timeline_span(session, vm_ids, hours=hours)
    width = max(span.end - span.start, 1.0) / TIMELINE_BUCKETS
    rows = await session.execute(
        text(
            """
SELECT g.vm_id,
       -- A sample written at the very end (or by a poll that began after this
       -- transaction) is drawn with the last bucket.
       least(floor((extract(epoch FROM s.recorded_at) - :start) / :width), :last) AS bucket,
       avg(s.utilization_pct) AS util,
       100.0 * sum(s.memory_used_mb) / nullif(sum(s.memory_total_mb), 0) AS mem
FROM gpus g
JOIN gpu_samples s ON s.gpu_id = g.id
    AND s.recorded_at >= to_timestamp(:start)
WHERE g.vm_id = ANY(CAST(:vm_ids AS int[]))
GROUP BY 1, 2
ORDER BY 1, 2
"""
        ),
        {
            "vm_ids": list(vm_ids),
            "start": span.start,
            "width": width,
            "last": TIMELINE_BUCKETS - 1,
        },
    )
    out: dict[int, list[dict[str, Any]]] = {vm_id: [] for vm_id in vm_ids}
    for r in rows:
        bucket = float(r.bucket)
        out[r.vm_id].append(
            {
                "t": round(span.start + (bucket + 0.5) * width, 3),
                "util": None if r.util is None else round(float(r.util), 1),
                "mem": None if r.mem is None else round(float(r.mem), 1),
            }
        )
    return out
