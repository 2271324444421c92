"""Multi-node jobs on the SSH test fleet with every real piece (poller, dispatcher, NATS,
Postgres, requeue manager): every rank launched with its rendezvous, the job completes
only when every rank has, and when one node is lost the other rank is killed and the
job runs again as a whole elsewhere. Only the GPUs are simulated."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import select

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.models import GPU, Leftover
from scheduler.requeue import RequeueConfig, RequeueManager
from scheduler.transport import Transport
from tests.backdate import age_outages
from tests.fleet import FAKE_TRAIN, SimFleet
from tests.workloads.support import (
    alive,
    job_nodes,
    job_row,
    new_job,
    publish,
    running_dispatcher,
    scheduling,
    sweep_until,
    wait_file,
    wait_status,
    write_fake_python,
)

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
CONFIG = RequeueConfig(interval_s=0.2, node_lost_timeout_s=2.0, recheck_after_s=0.5)


async def until_status(
    db: Database, poller: GpuPoller, requeue: RequeueManager, job_id: int, status: str
) -> None:
    """Sweep and tick until the job is `status` (a generous deadline, not a fixed wait)."""
    deadline = time.monotonic() + 60
    while (await job_row(db, job_id)).status != status:
        assert time.monotonic() < deadline, f"job {job_id} never became {status}"
        await poller.sweep()
        await requeue.tick()
        await asyncio.sleep(0.1)


async def test_a_two_node_job_runs_on_two_vms_with_its_rendezvous_and_completes(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """A 2 × 1 job on a fleet of two VMs: both ranks start with their rank, the node
    addresses in rank order, rank 0's address and a port chosen on rank 0's VM, and the
    job completes once both ranks exited 0, holding no GPU after."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(db, 1, ("--fake_seconds", "1.5"), nodes=2)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await requeue.tick()
        await wait_status(db, job_id, "running")
        rows = await job_nodes(db, job_id)
        assert [r.rank for r in rows] == [0, 1] and rows[0].vm_id != rows[1].vm_id
        assert all(r.remote_pid is not None and r.attempt_dir for r in rows)
        lines = [
            await wait_file(Path(r.attempt_dir) / "train.log", needle="node RLFLEET") for r in rows
        ]
        await until_status(db, poller, requeue, job_id, "completed")
    for rank, text in enumerate(lines):
        node = next(line for line in text.splitlines() if "fake_train: node" in line)
        assert f"RLFLEET_NODE_RANK={rank} RLFLEET_NUM_NODES=2 RLFLEET_GPUS_PER_NODE=1" in node
        assert "RLFLEET_NODE_ADDRS=127.0.0.1,127.0.0.1 MASTER_ADDR=127.0.0.1" in node
        assert "WORLD_SIZE=2" in node
        port = int(node.split("MASTER_PORT=")[1].split()[0])
        assert 0 < port < 65536
    assert lines[0].split("MASTER_PORT=")[1][:6] == lines[1].split("MASTER_PORT=")[1][:6]
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
        exits = [r.exit_code for r in (await job_nodes(db, job_id))]
    assert held is None and exits == [0, 0]


async def test_a_lost_node_kills_the_other_rank_and_the_job_runs_again_as_a_whole(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Chaos: rank 1's VM of a running 2 × 1 job drops off the network for longer than the
    node-lost timeout. The job fails as node_lost, rank 0 (on a VM that answers) is killed
    rather than left running alone, and the job runs again as a whole on the two VMs that
    answer, with `--resume auto`, and completes; no GPU stays held."""
    fleet = await sim_fleet(3, gpus_per_vm=1)
    ids = await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    by_id = {vm_id: fleet.by_name(name) for name, vm_id in ids.items()}
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(
        db, 1, ("--fake_seconds", "300", "--fake_retry_seconds", "1"), nodes=2, max_retries=0
    )
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await requeue.tick()
        await wait_status(db, job_id, "running")
        first = await job_nodes(db, job_id)
        assert all(r.remote_pid is not None for r in first)
        rank0_pid = first[0].remote_pid
        assert rank0_pid is not None and alive(rank0_pid)
        lost_id = first[1].vm_id
        assert lost_id is not None
        await by_id[lost_id].stop()  # its processes live on: a partition
        await sweep_until(poller, db, lost_id, "unreachable")
        await age_outages(db, CONFIG.node_lost_timeout_s + 1)
        report = await requeue.tick()
        assert report.node_lost == [job_id]
        deadline = time.monotonic() + 30
        while alive(rank0_pid):  # the requeue manager's kill sweep
            assert time.monotonic() < deadline, "rank 0 was left running alone"
            await requeue.tick()
            await asyncio.sleep(0.1)
        await until_status(db, poller, requeue, job_id, "completed")
        second = await job_nodes(db, job_id)
    job = await job_row(db, job_id)
    assert job.attempt == 2 and lost_id not in {r.vm_id for r in second}
    assert {r.attempt for r in second} == {2}
    for r in second:
        assert r.attempt_dir is not None and r.vm_id is not None
        assert by_id[r.vm_id].home in Path(r.attempt_dir).parents  # each rank on its own VM
        log = (Path(r.attempt_dir) / "train.log").read_text()
        assert "'--resume', 'auto'" in log
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
        left = (await session.execute(select(Leftover.vm_id, Leftover.killed_at))).all()
    assert held is None
    assert {vm for vm, _k in left} == {r.vm_id for r in first}
    assert [k is not None for vm, k in left if vm == first[0].vm_id] == [True]


async def test_a_rank_that_exits_0_after_another_rank_failed_does_not_complete_the_job(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Shared fate against "one success is enough": rank 1 of a 2 × 1 job exits 64 at once
    and fails the job (config_error), so rank 0 becomes a leftover; rank 0 then finishes
    on its own with exit 0 before the kill sweep reaches it. One rank's success is not the
    job's: the job stays failed for rank 1's reason, and rank 0's exit 0 is only noted on
    its node row."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    fails = ("--fake_exit", "64", "--fake_fail_rank", "1", "--fake_seconds", "3")
    job_id = await new_job(db, 1, fails, nodes=2, max_retries=0)
    async with scheduling(db, nats.url, transport, CONFIG) as requeue:
        await requeue.tick()
        await wait_status(db, job_id, "running")
        rank0_pid = (await job_nodes(db, job_id))[0].remote_pid
        assert rank0_pid is not None
        deadline = time.monotonic() + 60
        while (await job_row(db, job_id)).status != "failed":
            assert time.monotonic() < deadline, "rank 1's exit 64 never failed the job"
            await poller.sweep()
            await asyncio.sleep(0.1)
        assert alive(rank0_pid), "rank 0 ended before rank 1's failure was seen"
        while alive(rank0_pid):  # no requeue tick meanwhile: nothing kills it
            assert time.monotonic() < deadline, "rank 0 never finished"
            await asyncio.sleep(0.1)
        for _ in range(50):  # the kill sweep finds rank 0 gone, with exit 0
            await requeue.tick()
            async with db.transaction() as session:
                open_rows = await session.scalar(
                    select(Leftover.id).where(Leftover.killed_at.is_(None)).limit(1)
                )
            if open_rows is None:
                break
            await asyncio.sleep(0.1)
        assert open_rows is None
    job = await job_row(db, job_id)
    assert (job.status, job.failure_reason) == ("failed", "config_error"), job.status_reason
    assert [r.exit_code for r in await job_nodes(db, job_id)] == [0, 64]
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
    assert held is None


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`: a rank's whole tree."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


async def cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """Run the real `rlfleet` CLI as a subprocess without blocking the loop that serves
    the SSH test fleet: exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "scheduler.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_show_logs_and_cancel_reach_every_rank(
    sim_fleet: FleetFactory,
    db: Database,
    database_url: str,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """Through the real CLI, on a running 2 × 1 job: `job show --json` lists both ranks
    with their VM, GPUs and pid, and the text form a nodes table; `job logs --node R`
    reads rank R's log on its own VM (a rank the job lacks is exit 2 and one line);
    `job cancel` kills both ranks at once: when it returns, no process of either rank is
    alive, and a `--follow` of rank 1 has ended."""
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(db, 1, ("--fake_seconds", "300"), nodes=2)
    env = {
        **os.environ,
        "RLFLEET_DATABASE_URL": database_url,
        "RLFLEET_NATS_URL": nats.url,
        "RLFLEET_LOG_LEVEL": "WARNING",
    }
    nc = await nats_client.connect(nats.url)
    try:
        async with running_dispatcher(db, nats.url, transport=transport):
            await publish(nc, job_id)
            await wait_status(db, job_id, "running")
    finally:
        await nc.close()
    rows = await job_nodes(db, job_id)
    for r in rows:
        assert r.attempt_dir is not None
        await wait_file(Path(r.attempt_dir) / "train.log", needle="node RLFLEET")
    code, out, err = await cli(env, "job", "show", str(job_id), "--json", "--no-progress")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["nodes"] == 2
    # `gpus` is every GPU of the attempt, `gpus_per_node` each rank's
    assert (shown["gpus"], shown["gpus_per_node"]) == (2, [1, 1])
    code, out, err = await cli(env, "job", "list")
    assert code == 0, err
    listed = [ln.split() for ln in out.splitlines() if ln.split()[:1] == [str(job_id)]]
    assert len(listed) == 1 and "1×2" in listed[0]
    assert [
        (n["rank"], n["pid"], n["gpu_uuids"], n["gpu_indices"], n["state"]) for n in shown["ranks"]
    ] == [(r.rank, r.remote_pid, r.gpu_uuids, r.gpu_indices, "running") for r in rows]
    assert len({n["vm"] for n in shown["ranks"]}) == 2 and all(n["vm"] for n in shown["ranks"])
    code, out, err = await cli(env, "job", "show", str(job_id), "--no-progress")
    assert code == 0, err
    table = out.split("\nnodes:\n")[1].split("\nevents:")[0]
    assert all(n["vm"] in table and str(n["pid"]) in table for n in shown["ranks"])
    for rank in (0, 1):
        code, out, err = await cli(env, "job", "logs", str(job_id), "--node", str(rank))
        assert code == 0, err
        assert f"RLFLEET_NODE_RANK={rank} " in out
    code, out, err = await cli(env, "job", "logs", str(job_id), "--node", "2")
    assert code == 2 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        f"Error: job {job_id} has 2 nodes (ranks 0-1); there is no rank 2"
    ]
    follow = asyncio.create_task(cli(env, "job", "logs", str(job_id), "--node", "1", "--follow"))
    await asyncio.sleep(1)  # let it start reading; its end is what is checked
    assert not follow.done()
    code, out, err = await cli(env, "job", "cancel", str(job_id), "--grace", "2")
    assert code == 0, err
    pids = [r.remote_pid for r in rows]
    assert all(pid is not None for pid in pids)
    assert [group_alive(pid) for pid in pids if pid is not None] == [[], []]
    code, out, err = await asyncio.wait_for(follow, timeout=30)
    assert code == 0 and "RLFLEET_NODE_RANK=1 " in out, err
    async with db.transaction() as session:
        held = await session.scalar(select(GPU.id).where(GPU.job_id.is_not(None)).limit(1))
        open_leftovers = (
            await session.execute(select(Leftover.vm_id).where(Leftover.killed_at.is_(None)))
        ).all()
    assert held is None and open_leftovers == []
    code, out, err = await cli(env, "job", "show", str(job_id), "--json", "--no-progress")
    assert [n["state"] for n in json.loads(out)["ranks"]] == ["cancelled", "cancelled"]
