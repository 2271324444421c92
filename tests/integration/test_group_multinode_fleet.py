"""A role on several nodes inside a job group, on the SSH test fleet with every real piece
(poller, dispatcher, NATS, Postgres, requeue manager): a reward server beside rank 0 of a
trainer role that runs on two VMs (tests/workloads/group_client.py, which also makes the
ranks meet at the rendezvous the scheduler gave them). Each rank runs on its own VM, finds
the others at MASTER_ADDR:MASTER_PORT on rank 0's VM, reaches the server there; the group
completes when both ranks have, and a rank that dies takes every role on every VM with it
and the group runs again whole. Only the GPUs are simulated."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from scheduler.control import job_details
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL
from scheduler.job_logs import stream_log
from scheduler.jobspec import RENDEZVOUS_PORT, parse_data
from scheduler.models import VM, JobEvent, JobPort
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import (
    CLIENT,
    CONFIG,
    SERVER,
    _attempt_done,
    _dead,
    client_report,
    no_gpu_or_port_held,
    nothing_left,
    role_pid,
    spread_fleet,
    status_is,
    until,
)
from tests.workloads.support import job_nodes, job_row, new_job, scheduling, wait_file

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]


def two_node_roles(*, first_s: float, later_s: float = 1) -> dict[str, Any]:
    """A reward server, and a one-GPU trainer role on two nodes that depends on it."""
    return parse_data(
        {
            "roles": {
                "reward": {
                    "command": [sys.executable, SERVER, "--host", "$RLFLEET_REWARD_ADDR"],
                    "ports": ["http"],
                    "ready": {"http": "/health", "timeout": 60},
                },
                "trainer": {
                    "command": [sys.executable, CLIENT, str(first_s), str(later_s)],
                    "gpus": 1,
                    "nodes": 2,
                    "primary": True,
                    "depends_on": ["reward"],
                },
            }
        }
    ).to_data()


async def new_two_node_group(db: Database, **fields: Any) -> int:
    """Queue the group: 2 VMs, one GPU each (the server needs none)."""
    return await new_job(db, 2, nodes=2, model="-", dataset="-", reward_functions=("-",), **fields)


async def vm_names(db: Database) -> dict[int, str]:
    async with db.transaction() as session:
        return dict((await session.execute(select(VM.id, VM.name))).all())


async def test_each_rank_of_a_role_on_two_vms_meets_the_others_and_the_group_completes(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """Rank 0 of the trainer runs beside the server, rank 1 on the other VM. Both start
    once the server is ready, reach it at rank 0's VM, and meet at MASTER_ADDR (rank 0's
    address) and MASTER_PORT (the rendezvous port recorded for this attempt on rank 0's
    VM). `job show` lists each rank of the trainer with its VM and pid, `job logs --role
    trainer --node 1` reads rank 1's output on its VM. The job completes when both ranks
    have exited 0, the server is stopped, nothing is left running, no GPU or port held."""
    fleet, addresses, poller = await spread_fleet(sim_fleet, db, transport, 2)
    job_id = await new_two_node_group(db, roles=two_node_roles(first_s=5))
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        nodes = await job_nodes(db, job_id)
        assert [n.rank for n in nodes] == [0, 1] and nodes[0].vm_id != nodes[1].vm_id
        dirs = [Path(n.attempt_dir or "") for n in nodes]
        reports = [client_report(await wait_file(d / "trainer.log", needle="{")) for d in dirs]
        server = role_pid((dirs[0] / "train.log").read_text(), "reward")
        shown = await job_details(db, job_id, transport)
        chunks: list[bytes] = []
        await stream_log(db, transport, job_id, chunks.append, role="trainer", node=1)
        async with db.transaction() as session:
            rendezvous = (
                await session.execute(
                    select(JobPort.vm_id, JobPort.port).where(
                        JobPort.job_id == job_id, JobPort.name == RENDEZVOUS_PORT
                    )
                )
            ).all()
            partial = await session.scalar(PARTIAL_CLAIMS_SQL)
            double = await session.scalar(DOUBLE_BOOKED_SQL)
        await until(db, poller, requeue, status_is(db, job_id, "completed"), "completed")
        await until(db, poller, requeue, lambda: _dead(server), "the server stopped")
    assert (partial, double) == (0, 0)
    assert nodes[0].vm_id is not None and nodes[1].vm_id is not None
    first, second = addresses[nodes[0].vm_id], addresses[nodes[1].vm_id]
    assert rendezvous == [(nodes[0].vm_id, reports[0]["master"][1])]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["nodes"] == 2 and report["world_size"] == 2
        assert report["master"][0] == first and report["node_addrs"] == [first, second]
        assert report["addr"] == first and report["scores"] == [1.0]  # the server, on node 0
        assert report["gpus"] == nodes[rank].gpu_uuids[0]
    assert reports[0]["peers"] == [1] and reports[1]["answer"] == "welcome"
    train_logs = [(d / "train.log").read_text() for d in dirs]
    assert "role reward started" not in train_logs[1]  # node 1 runs its trainer rank only
    rank1 = train_logs[1].splitlines()
    assert rank1.index("rlfleet-group: role reward ready") < next(
        i for i, x in enumerate(rank1) if x.startswith("rlfleet-group: role trainer started")
    )  # rank 1 too waited for the server on the other VM
    names = await vm_names(db)
    trainers = [r for r in shown["roles"] if r["name"] == "trainer"]
    assert [(r["rank"], r["vm"], r["pid"]) for r in trainers] == [
        (0, names[nodes[0].vm_id], reports[0]["pid"]),
        (1, names[nodes[1].vm_id], reports[1]["pid"]),
    ]
    assert [r["gpu_uuids"] for r in trainers] == [list(n.gpu_uuids) for n in nodes]
    assert '"rank": 1' in b"".join(chunks).decode()
    assert (await job_row(db, job_id)).exit_code == 0
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)


async def test_a_dead_rank_kills_every_role_on_every_vm_and_the_group_runs_again_whole(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, transport: Transport
) -> None:
    """Rank 1 of the trainer is killed on its VM: rank 0 and the server on the other VM
    are killed too, the attempt fails once with a reason naming the rank and the role, and
    the group runs again as a whole (both ranks meet again) and completes."""
    fleet, _addresses, poller = await spread_fleet(sim_fleet, db, transport, 3)
    job_id = await new_two_node_group(db, max_retries=1, roles=two_node_roles(first_s=300))
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await until(db, poller, requeue, status_is(db, job_id, "running"), "running")
        first = await job_nodes(db, job_id)
        dirs = [Path(n.attempt_dir or "") for n in first]
        reports = [client_report(await wait_file(d / "trainer.log", needle="{")) for d in dirs]
        server = role_pid((dirs[0] / "train.log").read_text(), "reward")
        os.kill(reports[1]["pid"], signal.SIGKILL)
        for pid, what in ((reports[0]["pid"], "rank 0 killed"), (server, "server killed")):
            await until(db, poller, requeue, lambda pid=pid: _dead(pid), what)
        await until(db, poller, requeue, lambda: _attempt_done(db, job_id), "attempt 2 done")
        second = await job_nodes(db, job_id)
    assert {n.attempt for n in second} == {2}
    again = [client_report((Path(n.attempt_dir or "") / "trainer.log").read_text()) for n in second]
    assert [r["attempt"] for r in again] == [2, 2]
    assert again[0]["peers"] == [1] and again[1]["answer"] == "welcome"
    async with db.transaction() as session:
        events = (
            await session.execute(
                select(JobEvent.to_status, JobEvent.reason).where(JobEvent.job_id == job_id)
            )
        ).all()
    failed = [reason or "" for to, reason in events if to == "failed"]
    assert len(failed) == 1, events
    assert "rank 1" in failed[0] and "role trainer failed (exit 137)" in failed[0], failed
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)
