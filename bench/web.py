"""Benchmark: server time of the dashboard's queue, job and fleet pages on a big database.

Fills a fresh PostgreSQL with 10,000 jobs (each with its events, the finished ones with
progress samples) and 1,000 VMs x 8 GPUs with three hours of GPU samples, then renders
each page several times in-process through the ASGI application (what a request costs the
server: queries and templates, no network) and prints the medians against the 300 ms
target:

    web: jobs=10000 queue_ms=… job_ms=… fleet_ms=… (target 300 ms: queue x…, job x…, fleet x…)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from sqlalchemy import text  # noqa: E402

from scheduler.db import Database  # noqa: E402
from scheduler.embedded import EmbeddedPostgres  # noqa: E402
from scheduler.logging import configure  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from scheduler.transport import make_transport  # noqa: E402
from scheduler.web.app import create_app  # noqa: E402

TARGET_MS = 300.0
TOKEN = "bench-token-0123456789abcdef"

FILL = [
    # VMs and their GPUs, half of them allocated below.
    """
INSERT INTO vms (name, host, status, available_gpus, last_polled_at, last_seen_at)
SELECT format('gpu-node-%s', lpad(i::text, 4, '0')), format('10.0.%s.%s', i / 250, i % 250),
       'healthy', 4, now(), now()
FROM generate_series(1, :vms) AS i
""",
    """
INSERT INTO gpus (vm_id, index, uuid, name, memory_total_mb, memory_used_mb,
                  utilization_pct, healthy, foreign_busy)
SELECT v.id, g, format('GPU-%s-%s', v.id, g), 'NVIDIA H100 80GB HBM3', 81920,
       (g * 9000) % 81920, (g * 13) % 100, g <> 7 OR v.id % 50 <> 0, g = 6 AND v.id % 20 = 0
FROM vms v, generate_series(0, :gpus - 1) AS g
""",
    # Jobs: most finished, some running on the GPUs, some pending with a reason.
    """
INSERT INTO jobs (name, model, dataset, reward_function, status, status_reason, attempt,
                  gpus_requested, submitted_at, finished_at, exit_code)
SELECT format('grpo-run-%s', i), 'Qwen/Qwen2.5-0.5B-Instruct', 'openai/gsm8k', 'correctness',
       CASE WHEN i % 20 = 0 THEN 'pending' WHEN i % 25 = 0 THEN 'failed' ELSE 'completed' END,
       CASE WHEN i % 20 = 0 THEN 'no VM has 8 free GPUs' ELSE 'exited 0' END,
       CASE WHEN i % 20 = 0 THEN 0 ELSE 1 END, 1 + i % 8,
       now() - make_interval(secs => (:jobs - i) * 30), now() - make_interval(secs => i), 0
FROM generate_series(1, :jobs) AS i
""",
    """
UPDATE jobs SET status = 'running', status_reason = 'launched', finished_at = NULL,
       exit_code = NULL, vm_id = (jobs.id % :vms) + 1, gpu_indices = ARRAY[0, 1, 2, 3]
WHERE id > :jobs - 500 AND status = 'completed'
""",
    """
UPDATE gpus SET job_id = j.id FROM jobs j
WHERE j.status = 'running' AND gpus.vm_id = j.vm_id AND gpus.index < 4
""",
    """
INSERT INTO job_events (job_id, from_status, to_status, reason, actor, attempt, created_at)
SELECT j.id, e.f, e.t, e.r, e.a, 1, j.submitted_at + make_interval(secs => e.n)
FROM jobs j, (VALUES (0, NULL, 'queued', 'submitted', 'cli'),
                     (1, 'queued', 'starting', 'claimed', 'dispatcher:bench:1'),
                     (2, 'starting', 'running', 'launched', 'dispatcher:bench:1'),
                     (3, 'running', 'completed', 'exited 0', 'poller'))
     AS e(n, f, t, r, a)
WHERE j.status <> 'pending' OR e.n = 0
""",
    """
INSERT INTO progress_samples (job_id, attempt, step, reward, loss, recorded_at)
SELECT j.id, 1, s, s::float8 / :steps, 1.0 / s, j.submitted_at + make_interval(secs => s)
FROM jobs j, generate_series(1, :steps) AS s
WHERE j.attempt = 1
""",
    # Three hours of GPU samples, one every `every` seconds, for every GPU.
    """
INSERT INTO gpu_samples (gpu_id, utilization_pct, memory_used_mb, memory_total_mb, recorded_at)
SELECT g.id, (g.id * 7 + n) % 101, (g.id * 1000 + n * 50) % 81920, 81920,
       now() - make_interval(secs => n * :every)
FROM gpus g, generate_series(0, (3 * 3600) / :every - 1) AS n
""",
    "ANALYZE",
]


async def fill(db: Database, *, jobs: int, vms: int, gpus: int, steps: int, every: int) -> None:
    """Fill the database (one transaction per statement)."""
    params = {"jobs": jobs, "vms": vms, "gpus": gpus, "steps": steps, "every": every}
    for statement in FILL:
        started = time.monotonic()
        async with db.transaction() as session:
            await session.execute(text(statement), params)
        print(f"  fill: {statement.split()[0]} … {time.monotonic() - started:.1f}s", flush=True)


async def median_ms(client: httpx.AsyncClient, path: str, repeat: int) -> float:
    """The median server time of GET `path` over `repeat` requests (after one warm-up)."""
    times = []
    for i in range(repeat + 1):
        started = time.perf_counter()
        response = await client.get(path)
        elapsed = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise SystemExit(f"{path}: HTTP {response.status_code}: {response.text[:200]}")
        if i:
            times.append(elapsed)
    return statistics.median(times)


async def run(url: str, args: argparse.Namespace) -> str:
    db = Database(url, pool_size=4)
    try:
        await fill(
            db, jobs=args.jobs, vms=args.vms, gpus=args.gpus, steps=args.steps, every=args.every
        )
        async with db.transaction() as session:
            job_id = await session.scalar(
                text("SELECT max(id) FROM jobs WHERE status = 'completed'")
            )
            samples = await session.scalar(text("SELECT count(*) FROM gpu_samples"))
        print(f"  gpu samples: {samples}, progress samples per job: {args.steps}", flush=True)
        app = create_app(db, Settings.load(url, "nats://127.0.0.1:4222"), TOKEN, make_transport)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as client:
            queue = await median_ms(client, "/queue", args.repeat)
            job = await median_ms(client, f"/jobs/{job_id}", args.repeat)
            fleet = await median_ms(client, "/fleet", args.repeat)
    finally:
        await db.dispose()
    return (
        f"web: jobs={args.jobs} queue_ms={queue:.0f} job_ms={job:.0f} fleet_ms={fleet:.0f} "
        f"(target {TARGET_MS:.0f} ms: queue x{queue / TARGET_MS:.2f}, job x{job / TARGET_MS:.2f}, "
        f"fleet x{fleet / TARGET_MS:.2f}; vms={args.vms} gpus={args.vms * args.gpus})"
    )


def main() -> None:
    """Start Postgres, fill it, measure, print the result line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--vms", type=int, default=1_000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per VM")
    parser.add_argument("--steps", type=int, default=100, help="progress samples per job")
    parser.add_argument("--every", type=int, default=120, help="seconds between GPU samples")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    configure("WARNING")
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-web-") as tmp:
        postgres = EmbeddedPostgres(Path(tmp) / "pg", durable=False)
        try:
            postgres.start()
            url = postgres.create_database("bench")
            upgrade(url)
            line = asyncio.run(run(url, args))
        finally:
            postgres.stop()
    print(line)


if __name__ == "__main__":
    main()
