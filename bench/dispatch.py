"""Benchmark: a burst of 2000 one-GPU jobs through the real dispatcher, publish → running.

Embedded Postgres (durable: fsync and synchronous commit on, as in production) and
nats-server; 250 VMs × 8 GPUs inserted directly as polled and healthy. Each dispatcher is
a separate process running the real `GlobalJobDispatcher` (per fetched batch: one claim
transaction, concurrent launches, one running statement, acks) with one stand-in: its
transport answers every launch with a pid after a simulated round trip (`--launch-ms`,
default 10 ms, the cost of an exec on a pooled SSH connection) without starting anything —
this measures the scheduler, not SSH.
The jobs are inserted first, then published with plain `nc.publish("jobs.new", id)`.
Latency per job is `running_at − publish time`.

    .venv/bin/python bench/dispatch.py [--jobs 2000] [--vms 250] [--launch-ms 10] [--rate 300]

Environment knobs for experiments: BENCH_POOL (database connections per dispatcher,
default 10), BENCH_IN_FLIGHT (messages in flight per dispatcher, default 64), BENCH_BATCH
(messages per fetch, i.e. per claim transaction, default 32), BENCH_PROFILE=<prefix> (a CPU
profile of each dispatcher process).

Runs with 1 dispatcher (the baseline), then 2 fed at a steady `--rate` (default 300/s:
latency without the queueing of a burst), then 2 with the burst; the last line is
`dispatch: jobs=2000 dispatchers=2 jobs_per_s=… p50_ms=… p99_ms=… double_booked=0`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402
from sqlalchemy import text  # noqa: E402

from scheduler.db import Database  # noqa: E402
from scheduler.embedded import EmbeddedNats, EmbeddedPostgres  # noqa: E402
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402
from scheduler.remote.rendezvous import FREE_PORT_MARK  # noqa: E402
from scheduler.transport import CommandResult, VMTarget  # noqa: E402

GPUS_PER_VM = 8


class AckingTransport:
    """Answers a launch with a fresh pid after `latency_s`, as a VM that started it would."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self._pids = itertools.count(10_000)

    async def run(
        self, target: VMTarget, command: str, *, timeout: float, input: str | None = None
    ) -> CommandResult:
        """Acknowledge the command; launches get `rlfleet-pid <n>`."""
        await asyncio.sleep(self.latency_s)
        if FREE_PORT_MARK in command:  # rank 0's rendezvous port of a multi-node job
            return CommandResult(0, f"{FREE_PORT_MARK} 29500\n", "")
        if ".launch.lock" in command:
            return CommandResult(0, f"rlfleet-pid {next(self._pids)}\n", "")
        return CommandResult(0, "rlfleet-kill gone\n", "")

    async def close(self) -> None:
        """Nothing to close."""


async def worker(database_url: str, nats_url: str, launch_ms: float, ready_file: str) -> None:
    """One dispatcher process: run until SIGTERM."""
    from scheduler.dispatcher import GlobalJobDispatcher
    from scheduler.logging import configure

    configure("WARNING", json=True)
    db = Database(database_url, pool_size=int(os.environ.get("BENCH_POOL", "10")))
    nc = await nats.connect(nats_url)
    dispatcher = GlobalJobDispatcher(
        db,
        nc.jetstream(),
        AckingTransport(launch_ms / 1000),
        fetch_timeout_s=0.5,
        max_in_flight=int(os.environ.get("BENCH_IN_FLIGHT", "64")),
        batch=int(os.environ.get("BENCH_BATCH", "32")),
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(dispatcher.run(stop, ready))
    await ready.wait()
    Path(ready_file).write_text("ready")
    await task
    s = dispatcher.stats
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_ms = (usage.ru_utime + usage.ru_stime) * 1000
    print(
        f"worker {os.getpid()}: launched={s.launched} pending={s.pending} nak={s.nak} "
        f"contended={s.contended} "
        f"cpu_ms_per_job={cpu_ms / max(1, s.launched):.1f}",
        flush=True,
    )
    await nc.close()
    await db.dispose()


async def prepare(
    db: Database, n_vms: int, n_jobs: int, shapes: list[tuple[int, int]] | None = None
) -> list[int]:
    """Polled healthy VMs with idle GPUs, and `n_jobs` queued jobs: one-GPU jobs, or job
    i of the shape `shapes[i]` (nodes, GPUs per node)."""
    shapes = shapes or [(1, 1)] * n_jobs
    async with db.transaction() as session:
        await session.execute(
            text(
                "INSERT INTO vms (name, host, status, available_gpus, last_polled_at) "
                "SELECT 'vm' || i, '10.0.' || (i / 250) || '.' || (i % 250), 'healthy', "
                ":g, now() FROM generate_series(1, :n) i"
            ),
            {"n": n_vms, "g": GPUS_PER_VM},
        )
        await session.execute(
            text(
                "INSERT INTO gpus (vm_id, index, uuid, name, memory_total_mb, healthy) "
                "SELECT v.id, i, 'GPU-' || v.id || '-' || i, 'NVIDIA H100 80GB HBM3', 81559, "
                "true FROM vms v, generate_series(0, :g - 1) i"
            ),
            {"g": GPUS_PER_VM},
        )
        ids = (
            await session.execute(
                text(
                    "INSERT INTO jobs (model, dataset, reward_function, gpus_requested, "
                    "nodes, status, queued_at) SELECT 'Qwen/Qwen2.5-0.5B-Instruct', "
                    "'openai/gsm8k', 'correctness', g * k, k, 'queued', now() "
                    "FROM unnest(CAST(:k AS int[]), CAST(:g AS int[])) AS s(k, g) RETURNING id"
                ),
                {"k": [k for k, _g in shapes], "g": [g for _k, g in shapes]},
            )
        ).scalars()
        job_ids = sorted(ids)
        await session.execute(
            text(
                "INSERT INTO job_events (job_id, from_status, to_status, reason, actor) "
                "SELECT id, NULL, 'queued', 'submitted', 'bench' FROM jobs"
            )
        )
    async with db.transaction() as session:
        # A live database has statistics (autovacuum); a freshly filled one must be told.
        await session.execute(text("ANALYZE"))
    return job_ids


async def measure(
    pg: EmbeddedPostgres,
    nats_url: str,
    args: argparse.Namespace,
    dispatchers: int,
    run: int,
    rate: float | None = None,
    shapes: list[tuple[int, int]] | None = None,
) -> dict[str, float]:
    """One burst (or, with `rate`, a stream of that many publishes per second) with
    `dispatchers` worker processes on a fresh database; `shapes`: see `prepare`."""
    url = pg.create_database(f"bench_dispatch_{run}")
    upgrade(url)
    db = Database(url)
    job_ids = await prepare(db, args.vms, args.jobs, shapes)
    # A fresh stream per run, so that no message of the previous run is left.
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    with contextlib.suppress(Exception):  # the first run has none
        await js.delete_stream("RLFLEET_JOBS")
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(dispatchers):
            ready = Path(tmp) / f"ready{i}"
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        url,
                        nats_url,
                        str(args.launch_ms),
                        str(ready),
                    ]
                )
            )
            deadline = time.monotonic() + 30
            while not ready.exists():
                if time.monotonic() > deadline:
                    raise SystemExit("a dispatcher did not become ready")
                await asyncio.sleep(0.05)
        pg_cpu_before = postgres_cpu_s(pg)
        published: dict[int, float] = {}
        start = time.time()
        for i, job_id in enumerate(job_ids):
            if rate:  # paced: publish job i at start + i / rate
                await asyncio.sleep(max(0.0, start + i / rate - time.time()))
            published[job_id] = time.time()
            await nc.publish("jobs.new", str(job_id).encode())
        await nc.flush()
        deadline = time.monotonic() + 300
        while True:
            async with db.transaction() as session:
                running = await session.scalar(
                    text("SELECT count(*) FROM jobs WHERE status = 'running'")
                )
            if running == len(job_ids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        pg_cpu = postgres_cpu_s(pg) - pg_cpu_before
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    await nc.close()
    async with db.transaction() as session:
        rows = (
            await session.execute(
                text(
                    "SELECT id, extract(epoch FROM running_at), extract(epoch FROM starting_at) "
                    "FROM jobs WHERE status = 'running'"
                )
            )
        ).all()
        double_booked = await session.scalar(DOUBLE_BOOKED_SQL)
        partial = await session.scalar(PARTIAL_CLAIMS_SQL)
    await db.dispose()
    if len(rows) != len(job_ids):
        raise SystemExit(f"only {len(rows)} of {len(job_ids)} jobs reached running")
    latencies = sorted((float(t) - published[job_id]) * 1000 for job_id, t, _c in rows)
    claims = sorted((float(c) - published[job_id]) * 1000 for job_id, _t, c in rows)
    last = max(float(t) for _, t, _c in rows)
    print(f"postgres: cpu_ms_per_job={pg_cpu * 1000 / len(job_ids):.1f}", flush=True)
    return {
        "jobs_per_s": len(rows) / (last - start),
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1],
        "claim_p99_ms": claims[int(len(claims) * 0.99) - 1],
        "gpus_per_s": sum(k * g for k, g in (shapes or [(1, 1)] * len(rows))) / (last - start),
        "double_booked": double_booked,
        "partial_claims": partial,
    }


def postgres_cpu_s(pg: EmbeddedPostgres) -> float:
    """CPU seconds used so far by the Postgres server and its backends (live ones)."""
    import psutil

    assert pg._proc is not None
    total = 0.0
    root = psutil.Process(pg._proc.pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def line(jobs: int, dispatchers: int, r: dict[str, float]) -> str:
    """The figures of one run, in the format scripts parse."""
    return (
        f"dispatch: jobs={jobs} dispatchers={dispatchers} jobs_per_s={r['jobs_per_s']:.0f} "
        f"p50_ms={r['p50_ms']:.0f} p99_ms={r['p99_ms']:.0f} double_booked={int(r['double_booked'])}"
    )


async def main() -> None:
    """Baseline with one dispatcher, then two; print both and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--vms", type=int, default=250)
    parser.add_argument("--launch-ms", type=float, default=10.0)
    parser.add_argument("--no-durable", action="store_true", help="fsync off in Postgres")
    parser.add_argument(
        "--rate", type=float, default=300.0, help="publishes per second of the paced run"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        pg = EmbeddedPostgres(Path(tmp) / "pg", durable=not args.no_durable)
        pg.start()
        nats_server = EmbeddedNats(Path(tmp) / "nats").start()
        try:
            one = await measure(pg, nats_server.url, args, 1, 1)
            print(line(args.jobs, 1, one), flush=True)
            # Latency without queueing: the same jobs offered at a steady --rate.
            paced = await measure(pg, nats_server.url, args, 2, 3, rate=args.rate)
            print(f"paced at {args.rate:g}/s: " + line(args.jobs, 2, paced), flush=True)
            two = await measure(pg, nats_server.url, args, 2, 2)
            print(f"ratio: 2 dispatchers / 1 = {two['jobs_per_s'] / one['jobs_per_s']:.2f}x")
            print(line(args.jobs, 2, two), flush=True)
        finally:
            nats_server.stop()
            pg.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        args = (sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
        if os.environ.get("BENCH_PROFILE"):  # CPU profile of each dispatcher process
            import cProfile

            prof = cProfile.Profile(time.process_time)
            prof.runcall(asyncio.run, worker(*args))
            prof.dump_stats(os.environ["BENCH_PROFILE"] + f".{os.getpid()}")
        else:
            asyncio.run(worker(*args))
    else:
        asyncio.run(main())
