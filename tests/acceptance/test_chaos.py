"""Chaos: 200 jobs, single- and multi-node, on a 10-VM test fleet while daemons, NATS,
Postgres and VMs fail.

The real daemons run as subprocesses of the real CLI — two pollers (sharing the VMs),
two dispatchers, two requeue managers — against an embedded Postgres and nats-server of
the test's own, and ten SSH test VMs with two simulated GPUs each. While the jobs run:
one dispatcher is killed with SIGKILL (and started again later, as systemd would),
nats-server is restarted, Postgres is restarted, two VMs crash (one comes back) — one of
them under a rank of a running 2-node job — and some job ids are published three times.
In the end every job must be in the state its script implies, within its retry limits, with no GPU
ever double-booked, no gang ever holding only part of its GPUs, no job ever running twice
and no gang attempt ever running with only some of its ranks.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats as nats_client
import pytest
from sqlalchemy import func, select

from scheduler import bus
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats, EmbeddedPostgres
from scheduler.jobs import JobSpec, insert_job, mark_published
from scheduler.migrate import upgrade
from scheduler.models import GPU, VM, Job, JobEvent, JobNode, Leftover
from scheduler.retry import DEFAULT_POLICY, GIVE_UP_PREFIX
from tests.acceptance.chaos import (
    AuditSampler,
    Daemon,
    LiveSampler,
    Run,
    double_booked,
    duplicate_runs,
    live_ranks,
    publish_unless_down,
    runs_from,
)
from tests.fleet import SimFleet
from tests.workloads.support import FAKE_TRAIN, read_records, write_fake_python

FleetFactory = Callable[..., Awaitable[SimFleet]]
N_JOBS = 200
N_VMS = 10
GPUS_PER_VM = 2
DEADLINE_S = 300.0


@dataclass(frozen=True)
class Kind:
    """A scripted job: its fake_train flags and the end its script implies."""

    name: str
    count: int
    args: tuple[str, ...]
    gpus: int = 1
    max_retries: int = 3
    priority: int = 0
    ends: str = "completed"
    failure: str | None = None
    nodes: int = 1


KINDS = [
    # The long ones are submitted first, so that the VM crashes hit running work: single
    # jobs, and gangs whose rank 1 runs on the VM that crashes for good.
    Kind("long", 4, ("--fake_seconds", "40"), priority=5),
    Kind(
        "gang_long", 2, ("--fake_seconds", "30", "--fake_retry_seconds", "2"), priority=5, nodes=2
    ),
    Kind("oom_once", 15, ("--fake_oom_once", "--fake_seconds", "0.5")),
    Kind("config_error", 10, ("--fake_exit", "64"), ends="failed", failure="config_error"),
    Kind(
        "always_exit_1",
        10,
        ("--fake_exit", "1", "--fake_seconds", "0.2"),
        max_retries=2,
        ends="failed",
        failure="exit_nonzero",
    ),
    Kind("two_gpus", 10, ("--fake_seconds", "1"), gpus=2),
    Kind("gang", 16, (), nodes=2),
    # Rank 1 runs out of memory at once on the first attempt while rank 0 still trains:
    # rank 0 must be killed and the gang retried as a whole.
    Kind(
        "gang_rank_oom",
        6,
        ("--fake_oom_once", "--fake_fail_rank", "1", "--fake_seconds", "3"),
        nodes=2,
    ),
    Kind(
        "gang_config_error",
        4,
        ("--fake_exit", "64", "--fake_fail_rank", "1", "--fake_seconds", "3"),
        ends="failed",
        failure="config_error",
        nodes=2,
    ),
    Kind("ok", 123, ()),
]
HEAD = sum(k.count for k in KINDS if k.priority == 5)
"""The long jobs, submitted before all others."""


CHAOS_FAILURES = frozenset({"launch_failed", "node_lost"})
"""Failure reasons the chaos itself causes: a VM that crashed under a launch or a run."""


def job_specs(outputs: Path, rng: random.Random) -> list[tuple[Kind, JobSpec]]:
    """The 200 jobs, in submission order (long ones first, the rest shuffled)."""
    kinds = [k for k in KINDS for _ in range(k.count)]
    assert len(kinds) == N_JOBS and all(k.priority == 5 for k in kinds[:HEAD])
    head, tail = kinds[:HEAD], kinds[HEAD:]
    rng.shuffle(tail)
    specs = []
    for i, kind in enumerate(head + tail):
        args = kind.args
        if kind.name in ("ok", "gang"):
            args = ("--fake_seconds", f"{rng.uniform(0.2, 2.0):.2f}")
        specs.append(
            (
                kind,
                JobSpec(
                    model="tiny",
                    dataset="data.jsonl",
                    reward_functions=("format",),
                    gpus=kind.gpus,
                    nodes=kind.nodes,
                    max_retries=kind.max_retries,
                    priority=kind.priority or rng.choice((0, 0, 1, 2)),
                    name=f"{kind.name}-{i}",
                    extra_args=args,
                    # Outputs on storage every VM shares, as checkpoints for --resume would be.
                    output_dir=str(outputs / f"job{i}"),
                ),
            )
        )
    return specs


def daemons(url: str, nats_url: str, log_dir: Path, env: dict[str, str]) -> dict[str, Daemon]:
    """The six daemons, with the short intervals a test can afford; the two pollers divide
    the VMs between them."""
    conn = ["--database-url", url, "--nats-url", nats_url]
    py = [sys.executable, "-m"]
    requeue = [
        *py,
        "scheduler.requeue",
        *conn,
        "--interval",
        "0.5",
        "--node-lost-timeout",
        "3",
        "--pending-timeout",
        "10",
        "--republish-after",
        "20",
        "--retry-base-delay",
        "0.3",
        "--retry-max-delay",
        "2",
        "--kill-grace",
        "2",
    ]
    dispatcher = [*py, "scheduler.dispatcher", *conn, "--lease", "10", "--launch-timeout", "8"]
    poller = [*py, "scheduler.gpu_poller", *conn, "--interval", "0.5", "--unreachable-after", "2"]
    return {
        "poller-1": Daemon("poller-1", poller, log_dir, env),
        "poller-2": Daemon("poller-2", poller, log_dir, env),
        "dispatcher-1": Daemon("dispatcher-1", dispatcher, log_dir, env),
        "dispatcher-2": Daemon("dispatcher-2", dispatcher, log_dir, env),
        "requeue-1": Daemon("requeue-1", requeue, log_dir, env),
        "requeue-2": Daemon("requeue-2", requeue, log_dir, env),
    }


async def submit_all(
    db: Database,
    nats_url: str,
    specs: list[tuple[Kind, JobSpec]],
    env: dict[str, str],
    kind_of: dict[int, Kind],
) -> None:
    """Submit the jobs three ways: the real CLI (3 jobs), straight into the database with
    no publish at all (every 12th), and the rest as `rlfleet job submit` does it (insert,
    publish with the job's Nats-Msg-Id, mark published) over one shared connection. A
    publish that fails (NATS is restarted meanwhile) leaves the job unannounced, as the
    CLI does; the requeue manager must announce it."""
    cli_idx = {7, 77, 177}
    nc = await nats_client.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    js = nc.jetstream()

    async def one(i: int, kind: Kind, spec: JobSpec) -> None:
        if i in cli_idx:
            kind_of[await _submit_with_cli(spec, env)] = kind
            return
        async with db.transaction() as session:
            job = await insert_job(session, spec, actor="chaos")
            job_id, attempt = job.id, job.attempt
        kind_of[job_id] = kind
        if i % 12 == 5 or not nc.is_connected:
            return
        if not await publish_unless_down(js, job_id, attempt):
            return  # as the CLI: queued but not announced
        async with db.transaction() as session:
            await mark_published(session, job_id)

    # The long jobs first, so they start at once; then several submitters at a time, as
    # users would, with the (slow to start) CLI ones alongside.
    try:
        for i, (kind, spec) in enumerate(specs[:HEAD]):
            await one(i, kind, spec)
        queue = list(enumerate(specs))[HEAD:]

        async def submitter() -> None:
            while queue:
                i, (kind, spec) = queue.pop(0)
                await one(i, kind, spec)

        await asyncio.gather(*(submitter() for _ in range(6)))
    finally:
        await nc.close()


async def _submit_with_cli(spec: JobSpec, env: dict[str, str]) -> int:
    argv = [sys.executable, "-m", "scheduler.cli", "job", "submit", "--model", spec.model]
    argv += ["--dataset", spec.dataset, "--reward-function", spec.reward_functions[0]]
    argv += ["--gpus", str(spec.gpus), "--nodes", str(spec.nodes)]
    argv += ["--max-retries", str(spec.max_retries)]
    argv += ["--priority", str(spec.priority), "--name", spec.name or ""]
    argv += ["--output-dir", spec.output_dir or "", "--", *spec.extra_args]
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    # With NATS down the CLI still stores the job, prints its id and says so (exit 1).
    assert proc.returncode == 0 or "is queued but not announced" in err.decode(), err.decode()
    return int(out.decode().strip())


async def vms_running(db: Database, kind_of: dict[int, Kind], name: str) -> list[int]:
    """Ids of VMs where a job of kind `name` runs now. A job can run before its
    submitter has noted its kind (a CLI submission is known only once the CLI has
    printed its id); such a job is not counted yet."""
    async with db.transaction() as session:
        rows = (
            await session.execute(select(Job.id, Job.vm_id).where(Job.status == "running"))
        ).all()
    return sorted(
        {vm for job_id, vm in rows if vm and (k := kind_of.get(job_id)) and k.name == name}
    )


async def gangs_running(db: Database, kind_of: dict[int, Kind], name: str) -> dict[int, list[int]]:
    """The VMs of each rank (by rank) of the running gangs of kind `name`, by job id."""
    async with db.transaction() as session:
        rows = (
            await session.execute(
                select(JobNode.job_id, JobNode.vm_id)
                .join(Job, (Job.id == JobNode.job_id) & (Job.attempt == JobNode.attempt))
                .where(Job.status == "running")
                .order_by(JobNode.job_id, JobNode.rank)
            )
        ).all()
    found: dict[int, list[int]] = {}
    for job_id, vm in rows:
        if vm and (k := kind_of.get(job_id)) and k.name == name:
            found.setdefault(job_id, []).append(vm)
    return {job_id: vms for job_id, vms in found.items() if len(vms) == kind_of[job_id].nodes}


def settled(job: Job) -> bool:
    """A job in a state no daemon will move it out of."""
    if job.status in ("completed", "cancelled"):
        return True
    return job.status == "failed" and (job.status_reason or "").startswith(GIVE_UP_PREFIX)


async def test_only_a_nats_outage_counts_as_a_failed_publish(
    nats: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos submitter leaves a job unannounced only when NATS is down; any other
    error from a publish fails the test instead of passing as an outage."""
    # No reconnect buffer: a publish while reconnecting fails at once instead of in 5 s.
    nc = await nats_client.connect(
        nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, pending_size=0
    )
    try:
        js = nc.jetstream()
        await bus.ensure_stream(js)
        assert await publish_unless_down(js, 1, 0)

        async def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in the submit path")

        with monkeypatch.context() as patch:
            patch.setattr(bus, "publish_job", broken)
            with pytest.raises(RuntimeError, match="a bug"):
                await publish_unless_down(js, 2, 0)

        await asyncio.to_thread(nats.stop)
        for _ in range(100):
            if not nc.is_connected:
                break
            await asyncio.sleep(0.05)
        assert not await publish_unless_down(js, 3, 0)
    finally:
        await nc.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_chaos(
    sim_fleet: FleetFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Given 200 jobs, 28 of them 2-node gangs, when everything that can fail fails while
    they run, then every job ends as its script implies, none is lost, no GPU is
    double-booked, no gang holds part of its GPUs, no job ever runs twice, every gang
    attempt that ran ran all its ranks on distinct VMs, and nothing is left running."""
    rng = random.Random(20261121)
    records = tmp_path / "records"
    records.mkdir()
    # The SSH test VMs run in this process and pass its environment to what they start.
    monkeypatch.setenv("RLFLEET_FAKE_RECORD", str(records))
    pg = EmbeddedPostgres(tmp_path / "pg", durable=False)
    request.addfinalizer(pg.stop)  # also when the test fails half-way (stop is idempotent)
    await asyncio.to_thread(pg.start)
    nats = EmbeddedNats(tmp_path / "nats")
    request.addfinalizer(nats.stop)
    nats.start()
    url = pg.url()
    await asyncio.to_thread(upgrade, url)
    db = Database(url)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "RLFLEET_DATABASE_URL": url,
        "RLFLEET_NATS_URL": nats.url,
        # No attempt watchdogs: a 3 s node-lost timeout leaves no room for a safe fence
        # (the daemons would refuse it); fencing is proven in tests/integration/test_silent.py.
        "RLFLEET_FENCE_AFTER": "0",
    }
    env.pop("RLFLEET_FAKE_RECORD", None)
    fleet = await sim_fleet(N_VMS, gpus_per_vm=GPUS_PER_VM)
    await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(tmp_path))
    vm_names = {vm.name for vm in fleet}
    sampler = LiveSampler(frozenset(vm_names), str(records))
    sampler.start()
    audits = AuditSampler(url)
    audits.start()
    procs = daemons(url, nats.url, tmp_path, env)
    for daemon in procs.values():
        daemon.start()
    started = time.monotonic()
    chaos_log: list[str] = []

    def note(what: str) -> None:
        chaos_log.append(f"t={time.monotonic() - started:5.1f}s {what}")

    try:
        kind_of: dict[int, Kind] = {}
        specs = job_specs(tmp_path / "outputs", rng)
        submitting = asyncio.create_task(submit_all(db, nats.url, specs, env, kind_of))

        # --- the chaos, while jobs are submitted and run ---------------------------------
        # Crash two VMs, so the crashes surely hit running work: for good, the VM of rank 1
        # of a running long gang (its rank 0 lives on, on a VM that answers); for a while,
        # one that runs a long single-node job.
        gangs: dict[int, list[int]] = {}
        hosting: list[int] = []
        for _ in range(300):
            if submitting.done() and (failed := submitting.exception()) is not None:
                raise failed  # a submission failed: say why now, not after a minute
            gangs = await gangs_running(db, kind_of, "gang_long")
            gang_vms = {vm for vms in gangs.values() for vm in vms}
            hosting = [v for v in await vms_running(db, kind_of, "long") if v not in gang_vms]
            if gangs and hosting:
                break
            await asyncio.sleep(0.2)
        assert gangs and hosting, "no long gang and long job ran on distinct VMs"
        # The two pollers share the VMs (five each), not both polling all of them.
        async with db.transaction() as session:
            holders = Counter((await session.execute(select(VM.poller_id))).scalars())
        assert None not in holders and sorted(holders.values()) == [5, 5], holders
        hit_gang, (survivor_vm, lost_vm) = min(gangs.items())
        async with db.transaction() as session:
            hit_attempt = await session.scalar(select(Job.attempt).where(Job.id == hit_gang))
        names = {vm_id: name for name, vm_id in (await _vm_ids(db)).items()}
        # Both ranks have begun to train (written their start record) before the crash.
        for _ in range(100):
            if all(
                (records / f"{names[vm]}-{hit_gang}-{hit_attempt}.jsonl").exists()
                for vm in (survivor_vm, lost_vm)
            ):
                break
            await asyncio.sleep(0.1)
        procs["dispatcher-1"].kill9()
        note("dispatcher-1 killed with SIGKILL")
        gone, back = fleet.by_name(names[lost_vm]), fleet.by_name(names[hosting[0]])
        await gone.stop(kill_processes=True)
        await back.stop(kill_processes=True)
        note(
            f"VMs {gone.name} (for good; rank 1 of gang job {hit_gang}, rank 0 on "
            f"{names[survivor_vm]}) and {back.name} (for a while) crashed"
        )

        await asyncio.sleep(1.0)
        await asyncio.to_thread(nats.stop)
        note("nats-server stopped")
        await asyncio.sleep(1.5)
        await asyncio.to_thread(nats.start)
        note("nats-server started again")

        await submitting
        note(f"submitted {len(kind_of)} jobs")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pg.stop)
        note("Postgres stopped")
        await asyncio.sleep(1.5)
        await asyncio.to_thread(pg.start)
        note("Postgres started again")

        some = rng.sample(sorted(kind_of), 10)
        nc = await nats_client.connect(nats.url)
        for job_id in some:
            for _ in range(3):
                await nc.publish(bus.SUBJECT_NEW, str(job_id).encode())
        await nc.flush()
        await nc.close()
        note(f"published {len(some)} job ids three times each")

        procs["dispatcher-1"].start()
        note("dispatcher-1 started again")
        # The VM comes back once its jobs were moved off it as lost.
        for _ in range(300):
            if await _node_lost_on(db, back.name):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"no job on {back.name} was ever failed as node_lost")
        await back.start()
        note(f"VM {back.name} is back")

        # --- wait for the dust to settle -------------------------------------------------
        deadline = time.monotonic() + DEADLINE_S
        while True:
            async with db.transaction() as session:
                jobs = list((await session.execute(select(Job))).scalars())
            done = sum(settled(j) for j in jobs)
            if done == N_JOBS or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        note(f"{done}/{N_JOBS} jobs settled")
        # Leftovers on the VM that came back are killed by the requeue manager.
        for _ in range(100):
            if not await _open_leftovers(db, gone.name):
                break
            await asyncio.sleep(0.2)
        # Every rank of every attempt has ended, on every VM (killed ones exit at once).
        for _ in range(50):
            if not (alive := live_ranks(frozenset(vm_names), str(records))):
                break
            await asyncio.sleep(0.2)
    finally:
        await audits.stop()
        # Stopped from threads: the SSH test VMs live on this event loop, and a stopping
        # dispatcher may still be finishing a launch on one of them.
        codes = await asyncio.gather(*(asyncio.to_thread(d.stop) for d in procs.values()))
        exits = dict(zip(procs, codes, strict=True))
        sampler.stop()

    async with db.transaction() as session:
        jobs = list((await session.execute(select(Job))).scalars())
        lost_nodes = dict(
            (
                await session.execute(
                    select(JobEvent.job_id, func.count())
                    .where(JobEvent.to_status == "failed", JobEvent.reason.like("node_lost%"))
                    .group_by(JobEvent.job_id)
                )
            ).all()
        )
        # Attempts moved back to `queued` because their launch was never confirmed (a
        # dispatcher killed, or Postgres restarted, between the launch and its record).
        unconfirmed = dict(
            (
                await session.execute(
                    select(JobEvent.job_id, func.count())
                    .where(JobEvent.to_status == "queued", JobEvent.reason.like("claim lease%"))
                    .group_by(JobEvent.job_id)
                )
            ).all()
        )
        went_running = {
            (job_id, attempt)
            for job_id, attempt in await session.execute(
                select(JobEvent.job_id, JobEvent.attempt).where(JobEvent.to_status == "running")
            )
        }
        ended_lost = {
            (job_id, attempt)
            for job_id, attempt in await session.execute(
                select(JobEvent.job_id, JobEvent.attempt).where(
                    JobEvent.to_status == "failed", JobEvent.reason.like("node_lost%")
                )
            )
        }
        nodes = (await session.execute(select(JobNode))).scalars().all()
        rank_rows = {(n.job_id, n.rank): (n.attempt, n.vm_id) for n in nodes}
        held = await session.scalar(
            select(func.count()).select_from(GPU).where(GPU.job_id.is_not(None))
        )
    leftovers = await _open_leftovers(db, gone.name)
    # What a user sees of a job that ran out of retries.
    quitter = next(j for j in jobs if kind_of[j.id].name == "always_exit_1")
    show = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "scheduler.cli", "job", "show", str(quitter.id)),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    shown, _ = await show.communicate()
    await db.dispose()
    nats.stop()
    pg.stop()

    runs = runs_from(read_records(records), sampler)
    ids_of = {name: vm_id for vm_id, name in names.items()}
    gang_wrong = [
        fault
        for j in jobs
        if kind_of[j.id].nodes > 1
        for fault in _gang_faults(j, runs, went_running - ended_lost, rank_rows, ids_of)
    ]
    hit = next(j for j in jobs if j.id == hit_gang)
    hit_wrong = _crashed_gang_faults(hit, hit_attempt or 0, runs, lost_nodes, gone.name)
    booked = double_booked(runs) + sampler.double_booked_instants
    twice = duplicate_runs(runs) + sampler.duplicate_instants
    cut_short = {j.id: lost_nodes.get(j.id, 0) + unconfirmed.get(j.id, 0) for j in jobs}
    wrong = [_unexpected(j, kind_of[j.id], cut_short[j.id]) for j in jobs]
    wrong = [w for w in wrong if w]
    over_limit = [
        f"job {j.id}: {j.retry_count}/{j.max_retries} retries, {lost_nodes.get(j.id, 0)} lost nodes"
        for j in jobs
        if j.retry_count > j.max_retries
        or lost_nodes.get(j.id, 0) > DEFAULT_POLICY.node_lost_limit + 1
    ]
    statuses = Counter(j.status for j in jobs)
    completed = statuses["completed"]
    failed_ok = sum(
        1
        for j in jobs
        if j.status == "failed" and not _unexpected(j, kind_of[j.id], cut_short[j.id])
    )
    # Most scripted failures end for their own reason, not the chaos's.
    as_scripted = Counter(
        kind_of[j.id].name for j in jobs if j.failure_reason == kind_of[j.id].failure
    )
    lost = sum(1 for j in jobs if not settled(j))
    print()
    print("\n".join(chaos_log))
    print(f"jobs moved off a lost node: {len(lost_nodes)}; runs recorded: {len(runs)}")
    gang_runs = sum(1 for r in runs if kind_of[r.job_id].nodes > 1)
    print(
        f"gang jobs: {sum(k.count for k in KINDS if k.nodes > 1)}; rank runs recorded: "
        f"{gang_runs}; audits: {audits.audits} ({audits.skipped} skipped while Postgres was down)"
    )
    print(
        f"gang job {hit.id} (rank 1 lost with {gone.name} in attempt {hit_attempt}): "
        f"{hit.status} at attempt {hit.attempt}"
    )
    print(
        f"chaos: jobs={len(jobs)} completed={completed} failed_as_expected={failed_ok} "
        f"lost={lost} double_booked={len(booked)} duplicate_runs={len(twice)} "
        f"partial_claims={len(audits.partial_instants)} "
        f"double_booked_db={len(audits.double_booked_instants)} gang_faults={len(gang_wrong)}"
    )
    context = "\n".join(
        [*chaos_log, *(f"--- {d.name} (exit {exits[d.name]}):\n{d.tail()}" for d in procs.values())]
    )
    assert len(jobs) == N_JOBS
    assert "gave up after 2 retries: " in shown.decode(), shown.decode()
    assert lost == 0, f"{lost} jobs never settled: {dict(statuses)}\n{context}"
    assert not wrong, "\n".join(wrong[:20]) + "\n" + context
    assert not over_limit, over_limit
    for kind in KINDS:
        if kind.failure is not None:
            assert as_scripted[kind.name] >= kind.count - 2, (kind.name, as_scripted)
    assert not booked, booked[:10]
    assert not twice, twice[:10]
    # The database's own audits, every rank counted, at every instant they could run.
    assert not audits.partial_instants, audits.partial_instants[:10]
    assert not audits.double_booked_instants, audits.double_booked_instants[:10]
    assert audits.audits > 100
    assert not gang_wrong, "\n".join(gang_wrong[:20]) + "\n" + context
    assert not hit_wrong, "\n".join(hit_wrong) + "\n" + context
    assert held == 0, f"{held} GPUs still held by a job"
    assert not alive, [f"{s.vm} job {s.job_id}/{s.attempt} rank {s.rank}" for s in alive]
    assert lost_nodes, "no job was moved off a crashed VM: the chaos missed its target"
    # Every leftover on a VM that answers was killed (and its GPUs given back).
    assert not leftovers, leftovers
    assert sampler.scans > 100
    for name in ("poller-1", "poller-2", "dispatcher-2", "requeue-1", "requeue-2"):
        assert procs[name].starts == 1 and exits[name] == 0, f"{name} died\n{context}"


def _unexpected(job: Job, kind: Kind, lost: int) -> str | None:
    """Why the job's end does not match its script; None when it does. `lost`: how often
    an attempt of the job was cut short by the chaos (moved off a lost node, or back to
    `queued` because its launch was never confirmed)."""
    where = f"job {job.id} ({kind.name})"
    if job.status != kind.ends:
        return f"{where}: {job.status} ({job.status_reason}), expected {kind.ends}"
    # An attempt that ran out of memory on a VM that crashed before the poller saw its
    # exit ends as node_lost, which is no retry: the OOM retry is then not owed. Nor when
    # its launch was never confirmed (its lease expired): it goes back to `queued`
    # uncounted, and the next attempt finds the marker the OOM left and trains.
    if kind.name in ("oom_once", "gang_rank_oom") and job.retry_count < 1 and not lost:
        return f"{where}: completed without the OOM retry"
    if kind.ends == "failed":
        # Its last attempt may have been cut short by the chaos itself instead.
        if job.failure_reason != kind.failure and job.failure_reason not in CHAOS_FAILURES:
            return f"{where}: failed with {job.failure_reason}, expected {kind.failure}"
        if kind.name == "always_exit_1" and job.retry_count != job.max_retries:
            return f"{where}: gave up after {job.retry_count}/{job.max_retries} retries"
        if not (job.status_reason or "").startswith(GIVE_UP_PREFIX):
            return f"{where}: failed without saying it gave up ({job.status_reason})"
    return None


def _gang_faults(
    job: Job,
    runs: list[Run],
    went_running: set[tuple[int, int]],
    rank_rows: dict[tuple[int, int], tuple[int, int | None]],
    ids_of: dict[str, int],
) -> list[str]:
    """What is wrong with a gang's runs: an attempt the job counted as running (and did
    not lose to a crashed VM, which may kill a rank before it records its start) without
    every rank started, two ranks (or one rank twice) of an attempt on one VM, or a
    completed job whose last attempt's ranks and `job_nodes` rows disagree."""
    where = f"gang job {job.id}"
    by_attempt: dict[int, list[Run]] = {}
    for run in runs:
        if run.job_id == job.id:
            by_attempt.setdefault(run.attempt, []).append(run)
    everyone = set(range(job.nodes))
    faults = []
    for attempt, own in sorted(by_attempt.items()):
        ranks = sorted(r.rank for r in own)
        # An attempt cut short while launching (a crash, an expired lease) may have started
        # some ranks only; the job must then never have counted it as running.
        if set(ranks) != everyone and (job.id, attempt) in went_running:
            faults.append(f"{where}: attempt {attempt} was running with ranks {ranks} only")
        if len(ranks) != len(set(ranks)) or len({r.vm for r in own}) != len(own):
            faults.append(f"{where}: attempt {attempt} ran ranks {ranks} on {[r.vm for r in own]}")
    if job.status == "completed":
        last = by_attempt.get(job.attempt, [])
        if sorted(r.rank for r in last) != sorted(everyone):
            ran = sorted(r.rank for r in last)
            faults.append(f"{where}: completed attempt {job.attempt} ran ranks {ran}")
        for run in last:
            row = rank_rows.get((job.id, run.rank))
            if row != (job.attempt, ids_of.get(run.vm)):
                faults.append(f"{where}: rank {run.rank} ran on {run.vm}, job_nodes has {row}")
    return faults


def _crashed_gang_faults(
    job: Job, attempt: int, runs: list[Run], lost_nodes: dict[int, int], gone: str
) -> list[str]:
    """What is wrong with the gang whose rank 1 crashed with its VM: it must have failed as
    node_lost, run again as a whole (never on the lost VM) and ended within its limits,
    and its surviving rank must have ended before any later attempt started."""
    where = f"gang job {job.id} (rank 1 lost in attempt {attempt})"
    faults = []
    if not lost_nodes.get(job.id):
        faults.append(f"{where}: never failed as node_lost")
    if not settled(job) or job.attempt <= attempt:
        faults.append(f"{where}: {job.status} at attempt {job.attempt}, not retried to an end")
    survivor = [r for r in runs if r.job_id == job.id and r.attempt == attempt and r.rank == 0]
    later_runs = [r for r in runs if r.job_id == job.id and r.attempt > attempt]
    if any(r.vm == gone for r in later_runs):
        faults.append(f"{where}: ran again on the lost VM {gone}")
    later = [r.start for r in later_runs]
    if not survivor or (later and max(r.end for r in survivor) > min(later)):
        faults.append(f"{where}: rank 0 {survivor} outlived its attempt")
    return faults


async def _node_lost_on(db: Database, vm_name: str) -> bool:
    """Whether some job was failed as node_lost on the VM."""
    async with db.transaction() as session:
        found = await session.scalar(
            select(func.count())
            .select_from(JobEvent)
            .where(
                JobEvent.reason.like(f"node_lost: VM {vm_name} %"),
                JobEvent.to_status == "failed",
            )
        )
    return bool(found)


async def _open_leftovers(db: Database, lost_for_good: str) -> list[tuple[int, int, str]]:
    """(job, attempt, VM) of leftovers not yet killed on VMs that answer again."""
    async with db.transaction() as session:
        rows = await session.execute(
            select(Leftover.job_id, Leftover.attempt, VM.name)
            .join(VM, VM.id == Leftover.vm_id)
            .where(Leftover.killed_at.is_(None), VM.name != lost_for_good)
        )
        return [(j, a, n) for j, a, n in rows]


async def _vm_ids(db: Database) -> dict[str, int]:
    async with db.transaction() as session:
        return {name: vm_id for name, vm_id in (await session.execute(select(VM.name, VM.id)))}
