"""Every kind of attempt on one path, on the SSH test fleet with every real piece (poller,
dispatcher, NATS, Postgres, requeue manager): a single-node job, a multi-node job and a
job group spread over two VMs each have one `job_nodes` row per VM, rank 0 included, and
are probed and finished by the same functions (`gpu_poller.finish.load_ranks`,
`gpu_poller.finish.finish_rank`), rank 0 like any other rank. Only the GPUs are simulated."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import gpu_poller
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import finish, sweep
from scheduler.jobspec import parse_data
from scheduler.transport import Transport
from scheduler.verdicts import JobVerdict, LiveJob
from tests.fleet import FAKE_TRAIN, SimFleet
from tests.integration.test_groups_fleet import CONFIG, no_gpu_or_port_held, status_is, until
from tests.workloads.support import job_nodes, new_job, scheduling, write_fake_python

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]


def spread_group() -> dict[str, Any]:
    """A group whose one primary role runs on two VMs (one GPU each) for a second."""
    return parse_data(
        {
            "roles": {
                "work": {
                    "command": [sys.executable, "-c", "import time; time.sleep(1)"],
                    "gpus": 1,
                    "nodes": 2,
                    "primary": True,
                }
            }
        }
    ).to_data()


async def test_single_multi_node_and_group_attempts_take_one_probe_and_finish_path(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given five one-GPU VMs and three jobs, one of each kind, when they run to the end,
    then each is completed, each has its `job_nodes` rows (rank 0 included) with every
    rank's exit 0, the one loader handed every rank of each to the probe, and the one
    finishing function saw every rank of each end; nothing holds a GPU or port after."""
    fleet = await sim_fleet(5, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    poller = gpu_poller.GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    probed: set[tuple[int, int]] = set()
    finished: list[tuple[int, int, bool]] = []
    load_ranks, finish_rank = finish.load_ranks, finish.finish_rank

    async def recording_load(session: AsyncSession, installation: str) -> list[LiveJob]:
        ranks = await load_ranks(session, installation)
        probed.update((job.id, job.rank) for job in ranks)
        return ranks

    async def recording_finish(session: AsyncSession, verdict: JobVerdict, vm: str) -> bool:
        moved = await finish_rank(session, verdict, vm)
        finished.append((verdict.job.id, verdict.job.rank, moved))
        return moved

    # (each where it is called: the sweep loads the ranks, `finish` finishes them)
    monkeypatch.setattr(sweep, "load_ranks", recording_load)
    monkeypatch.setattr(finish, "finish_rank", recording_finish)
    single = await new_job(db, 1, ("--fake_seconds", "1"))
    multi = await new_job(db, 1, ("--fake_seconds", "1"), nodes=2)
    group = await new_job(
        db, 2, nodes=2, roles=spread_group(), model="-", dataset="-", reward_functions=("-",)
    )
    jobs = {single: 1, multi: 2, group: 2}
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        for job_id in jobs:
            await until(db, poller, requeue, status_is(db, job_id, "completed"), f"{job_id} done")
    for job_id, nodes in jobs.items():
        rows = await job_nodes(db, job_id)
        assert [(r.rank, r.attempt, r.exit_code) for r in rows] == [
            (rank, 1, 0) for rank in range(nodes)
        ], job_id
        assert all(r.vm_id is not None and r.remote_pid and r.attempt_dir for r in rows)
        assert len({r.vm_id for r in rows}) == nodes
        ranks = set(range(nodes))
        assert {rank for j, rank in probed if j == job_id} == ranks, job_id
        assert {rank for j, rank, _moved in finished if j == job_id} == ranks, job_id
        # The job moved once: on the end of its last rank.
        assert [moved for j, _rank, moved in finished if j == job_id].count(True) == 1
    await no_gpu_or_port_held(db)
