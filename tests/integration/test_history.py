"""History for the dashboard: the poller records progress samples per step and GPU samples
per poll, and prunes them after the retention (real Postgres, real SSH fleet)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import func, select, text, update

from scheduler.db import Database
from scheduler.errors import BadInput
from scheduler.fleet import set_gpu_draining
from scheduler.gpu_poller import GpuPoller
from scheduler.history import (
    TIMELINE_BUCKETS,
    history_days,
    job_curve,
    timeline_span,
    vm_timelines,
)
from scheduler.models import GpuEvent, GpuSample, ProgressSample
from scheduler.transport import Transport
from tests.integration.test_poller import launch_job
from tests.workloads.support import job_attempt_dir


async def count(db: Database, model: type) -> int:
    async with db.transaction() as session:
        return int(await session.scalar(select(func.count()).select_from(model)) or 0)


async def test_polls_record_one_progress_sample_per_step_and_gpu_samples_per_poll(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given a running job on a VM with two GPUs
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    await poller.sweep()
    job_id = await launch_job(db, transport, fleet[0], vm_id, 0, "--fake_seconds", "60")
    progress = await job_attempt_dir(db, job_id, fleet[0].home) / "progress.json"
    # When its progress.json says step 1, then (twice) step 2, then garbage, with polls between
    for content in (
        {"step": 1, "reward": 0.25, "loss": 1.5},
        {"step": 2, "reward": 0.5, "loss": None},
        {"step": 2, "reward": 0.75, "loss": 0.5},
    ):
        progress.write_text(json.dumps(content, indent=2))
        await poller.sweep()
    progress.write_text('{"step": 3, "rew')
    await poller.sweep()
    # Then the curve has one point per step, as first seen; the cut file added none
    async with db.transaction() as session:
        curve = await job_curve(session, job_id)
        timelines = await vm_timelines(session, [vm_id], hours=1)
    assert [(p["attempt"], p["step"], p["reward"], p["loss"]) for p in curve] == [
        (1, 1, 0.25, 1.5),
        (1, 2, 0.5, None),
    ]
    # And every poll of a reachable VM wrote one sample per GPU (5 polls x 2 GPUs)
    assert await count(db, GpuSample) == 10
    assert len(timelines[vm_id]) >= 1
    assert all(0 <= p["util"] <= 100 and 0 <= p["mem"] <= 100 for p in timelines[vm_id])


async def test_samples_older_than_the_retention_are_pruned(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given samples of a job and of GPUs, some of them 8 days old
    fleet = await sim_fleet(1, gpus_per_vm=1)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport, history_days=7)
    await poller.sweep()
    job_id = await launch_job(db, transport, fleet[0], vm_id, 0, "--fake_seconds", "60")
    progress = await job_attempt_dir(db, job_id, fleet[0].home) / "progress.json"
    for step in (1, 2):
        progress.write_text(json.dumps({"step": step, "reward": 1.0}))
        await poller.sweep()
    # (and two GPU health events, the first of them 8 days old)
    async with db.transaction() as session:
        await set_gpu_draining(session, "vm0", "0", True)
        await set_gpu_draining(session, "vm0", "0", False)
    async with db.transaction() as session:
        for model, stamp in (
            (GpuSample, GpuSample.recorded_at),
            (ProgressSample, ProgressSample.recorded_at),
            (GpuEvent, GpuEvent.created_at),
        ):
            oldest = select(func.min(model.id)).scalar_subquery()
            await session.execute(
                update(model)
                .where(model.id == oldest)
                .values({stamp.key: stamp - timedelta(days=8)})
            )
    gpu_before, progress_before = await count(db, GpuSample), await count(db, ProgressSample)
    # When the poller prunes (it does so at most once a minute; force it now)
    deleted = await poller.prune_history(force=True)
    # Then exactly the old ones are gone
    assert deleted == 3
    assert await count(db, GpuSample) == gpu_before - 1
    assert await count(db, ProgressSample) == progress_before - 1
    async with db.transaction() as session:
        kinds = (await session.scalars(select(GpuEvent.kind))).all()
    assert kinds == ["undrained"]
    async with db.transaction() as session:
        assert [p["step"] for p in await job_curve(session, job_id)] == [2]


async def test_a_vm_polled_for_a_minute_has_a_timeline_across_that_minute(
    db: Database, sim_fleet, transport: Transport
) -> None:
    # Given a VM with one GPU polled five times, the polls 15 s apart over the last minute
    fleet = await sim_fleet(1, gpus_per_vm=1)
    vm_id = (await fleet.register(db))["vm0"]
    poller = GpuPoller(db, transport)
    for _ in range(5):
        await poller.sweep()
    async with db.transaction() as session:
        await session.execute(
            text(
                "UPDATE gpu_samples SET recorded_at = now() - make_interval(secs => 15 * "
                "((SELECT max(id) FROM gpu_samples) - id))"
            )
        )
    # When the fleet page asks for the timelines of the last 3 hours
    async with db.transaction() as session:
        span = await timeline_span(session, [vm_id], hours=3)
        points = (await vm_timelines(session, [vm_id], hours=3, span=span))[vm_id]
        default = (await vm_timelines(session, [vm_id], hours=3))[vm_id]
    # Then they span that minute, not three hours in which it would be one dot at the end
    assert 59 <= span.end - span.start <= 61, span
    # And each poll is a point of its own, spread over the span, inside it
    assert len(points) == 5, points
    times = [p["t"] for p in points]
    assert times == sorted(times) and span.start <= times[0] and times[-1] <= span.end
    assert times[-1] - times[0] >= 0.9 * (span.end - span.start) - 2 * (60 / TIMELINE_BUCKETS)
    assert [p["util"] for p in points] == [0.0] * 5
    assert default == points


async def test_an_empty_fleet_has_a_span_and_no_points(db: Database, sim_fleet) -> None:
    fleet = await sim_fleet(1, gpus_per_vm=1)
    vm_id = (await fleet.register(db))["vm0"]
    async with db.transaction() as session:
        span = await timeline_span(session, [vm_id], hours=3)
        assert await vm_timelines(session, [vm_id], hours=3) == {vm_id: []}
    assert span.end - span.start == 3 * 3600


def test_the_retention_comes_from_the_environment() -> None:
    assert history_days({}) == 7.0
    assert history_days({"RLFLEET_HISTORY_DAYS": "0.5"}) == 0.5
    for bad in ("0", "-1", "x", "99999"):
        with pytest.raises(BadInput):
            history_days({"RLFLEET_HISTORY_DAYS": bad})
