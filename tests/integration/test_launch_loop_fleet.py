"""Every kind of attempt goes through the dispatcher's one launch loop, on the SSH test
fleet with every real piece (Postgres, NATS, the dispatcher, SSH servers): a job of one
VM, a multi-node job, a job group on one VM and a group over two VMs are each started by
`Launcher.launch`, one `Launcher.launch_node` call per node, what differs between them
being the data of each node (its rendezvous place, its group config). Only the GPUs are
simulated; the recorder wraps our own functions and calls them through."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from scheduler.claims.result import Claim
from scheduler.db import Database
from scheduler.dispatcher.launch import Launcher, NodeLaunch
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.remote.launch import LaunchResult
from scheduler.requeue import RequeueConfig
from scheduler.transport import Transport, VMTarget
from tests.fleet import FAKE_TRAIN, SimFleet
from tests.integration.test_groups_fleet import group_roles, spread_roles
from tests.workloads.support import job_nodes, job_row, new_job, scheduling, write_fake_python

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, node_lost_timeout_s=30.0, recheck_after_s=0.5)
GROUP: dict[str, Any] = {"model": "-", "dataset": "-", "reward_functions": ("-",)}


async def test_single_multi_node_and_group_attempts_go_through_the_one_launch_loop(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[int] = []
    nodes: dict[int, list[NodeLaunch]] = {}
    launch, launch_node = Launcher.launch, Launcher.launch_node

    async def recorded_launch(self: Launcher, claim: Claim, target: VMTarget) -> LaunchResult | str:
        attempts.append(claim.job_id)
        return await launch(self, claim, target)

    async def recorded_node(
        self: Launcher, claim: Claim, node: NodeLaunch, *args: Any
    ) -> LaunchResult | str:
        nodes.setdefault(claim.job_id, []).append(node)
        return await launch_node(self, claim, node, *args)

    monkeypatch.setattr(Launcher, "launch", recorded_launch)
    monkeypatch.setattr(Launcher, "launch_node", recorded_node)

    fleet = await sim_fleet(2, gpus_per_vm=4)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    await GpuPoller(db, transport, unreachable_after=1).sweep()
    single = await new_job(db, 1, ("--fake_seconds", "30"))
    multi = await new_job(db, 1, ("--fake_seconds", "30"), nodes=2)
    group = await new_job(db, 1, roles=group_roles(first_s=30), **GROUP)
    spread = await new_job(db, 2, nodes=2, roles=spread_roles(first_s=30), **GROUP)
    kinds = (single, multi, group, spread)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await requeue.tick()  # announces the queued jobs
        deadline = time.monotonic() + 60
        while [(await job_row(db, j)).status for j in kinds] != ["running"] * 4:
            assert time.monotonic() < deadline, [(await job_row(db, j)).status for j in kinds]
            await asyncio.sleep(0.1)
        ranks = {
            j: [(n.rank, n.remote_pid is not None) for n in await job_nodes(db, j)]
            for j in (multi, spread)
        }

    # One loop launched each attempt once, and the same function each of its nodes.
    assert sorted(attempts) == sorted(kinds)
    assert {j: [n.rank for n in nodes.get(j, [])] for j in kinds} == {
        single: [0],
        multi: [0, 1],
        group: [0],
        spread: [0, 1],
    }
    # What differs between the kinds is each node's data.
    assert [n.rendezvous is None and n.group is None for n in nodes[single]] == [True]
    assert [n.rendezvous and n.rendezvous.num_nodes for n in nodes[multi]] == [2, 2]
    assert all(n.group is None for n in nodes[multi])
    assert [n.group is not None and n.rendezvous is None for n in nodes[group]] == [True]
    assert [n.group is not None for n in nodes[spread]] == [True, True]
    assert nodes[spread][0].target.id != nodes[spread][1].target.id
    assert nodes[multi][0].target.id != nodes[multi][1].target.id
    # The ranks it started are recorded where the attempt has rows for them.
    assert ranks == {multi: [(0, True), (1, True)], spread: [(0, True), (1, True)]}
