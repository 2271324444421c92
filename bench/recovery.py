"""Recovery time after a VM crash and after a VM goes silent, with the DEFAULT settings.

A 3-VM SSH test fleet (2 simulated GPUs each), embedded Postgres and NATS, and the real
poller, dispatcher and requeue manager in this process with their default intervals and
timeouts (scheduler/liveness.py). Two long jobs run on one VM, then that VM:

- crashes (SSH server gone, processes killed): `crash_s` is from the crash until both jobs
  are `running` again elsewhere;
- goes silent (a network black hole: TCP connects, nothing answers, its processes run
  on): `silent_s` is from the silence until both jobs run elsewhere, and the old attempts
  must have stopped themselves (fenced) before that;
- is silent for 10 s only (a blip): `blip_restarts` counts attempts restarted because of
  it, watched until well past the node-lost timeout; it must be 0.

Each figure is the median over `--trials` fresh installations (`--quick`: one).

    .venv/bin/python bench/recovery.py [--trials N | --quick]

Target: crash_s and silent_s <= 30 s, blip_restarts = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sqlalchemy import select  # noqa: E402

from scheduler.db import Database  # noqa: E402
from scheduler.dispatcher import run_dispatcher  # noqa: E402
from scheduler.embedded import EmbeddedNats, EmbeddedPostgres  # noqa: E402
from scheduler.gpu_poller import run_poller  # noqa: E402
from scheduler.jobs import JobSpec  # noqa: E402
from scheduler.liveness import Liveness  # noqa: E402
from scheduler.logging import configure  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402
from scheduler.models import Job  # noqa: E402
from scheduler.requeue import RequeueConfig, run_daemon  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from scheduler.submit import submit_job  # noqa: E402
from scheduler.transport import make_transport  # noqa: E402
from tests.fleet import start_fleet  # noqa: E402
from tests.workloads.support import FAKE_TRAIN, write_fake_python  # noqa: E402

TARGET_S = 30.0
BLIP_S = 10.0
MODES = ("crash", "silent", "blip")


async def job_rows(db: Database, ids: list[int]) -> list[tuple[str, int | None, int]]:
    """(status, vm_id, attempt) of each job."""
    async with db.transaction() as session:
        rows = await session.execute(
            select(Job.status, Job.vm_id, Job.attempt).where(Job.id.in_(ids)).order_by(Job.id)
        )
        return [(r[0], r[1], r[2]) for r in rows]


async def wait_running(
    db: Database, ids: list[int], *, not_vm: int | None, timeout: float
) -> float:
    """Wait until every job is running (on a VM other than `not_vm`); returns the time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s == "running" and vm != not_vm for s, vm, _ in await job_rows(db, ids)):
            return time.monotonic()
        await asyncio.sleep(0.1)
    raise TimeoutError(f"jobs {ids} not running after {timeout:.0f}s")


def groups_alive(home: Path, ids: list[int]) -> bool:
    """Whether any process of the jobs' first attempts still runs on the VM at `home`."""
    for job_id in ids:
        for pid_file in home.glob(f".rlfleet/*/jobs/{int(job_id)}/1-*/pid"):
            with contextlib.suppress(OSError, ValueError):
                os.killpg(int(pid_file.read_text()), 0)
                return True
    return False


async def trial(root: Path, n: int, mode: str) -> float:
    """One failure of one VM in a fresh installation; returns the seconds it took the jobs
    to run elsewhere (crash, silent) or the number of restarts (blip)."""
    pg = EmbeddedPostgres(root / f"pg{n}{mode}", durable=False)
    await asyncio.to_thread(pg.start)
    nats = EmbeddedNats(root / f"nats{n}{mode}").start()
    await asyncio.to_thread(upgrade, pg.url())
    settings = Settings(database_url=pg.url(), nats_url=nats.url)
    db = Database(pg.url())
    fleet = await start_fleet(root / f"fleet{n}{mode}", 3, gpus_per_vm=2, silenceable=True)
    ids_by_name = await fleet.register(
        db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(root)
    )
    stop = asyncio.Event()
    transport = make_transport()
    tasks = [
        asyncio.create_task(run_poller(db, transport, stop)),
        asyncio.create_task(run_dispatcher(settings, stop)),
        asyncio.create_task(run_daemon(settings, RequeueConfig(), stop)),
    ]
    try:
        # Let the first poll see the fleet, as a running installation would have.
        await asyncio.sleep(6.0)
        spec = JobSpec(
            model="tiny",
            dataset="data.jsonl",
            reward_functions=("format",),
            extra_args=("--fake_seconds", "600"),
        )
        ids = [(await submit_job(db, settings, spec, actor="bench")).job_id for _ in range(2)]
        await wait_running(db, ids, not_vm=None, timeout=60)
        vm_ids = {vm for _, vm, _ in await job_rows(db, ids)}
        assert len(vm_ids) == 1, "both jobs should share the best-fitting VM"
        (lost_vm,) = vm_ids
        vm = fleet.by_name(next(k for k, v in ids_by_name.items() if v == lost_vm))
        t0 = time.monotonic()
        if mode == "crash":
            await vm.stop(kill_processes=True)
            return await wait_running(db, ids, not_vm=lost_vm, timeout=120) - t0
        vm.silence()
        if mode == "silent":
            try:
                done = await wait_running(db, ids, not_vm=lost_vm, timeout=120) - t0
                if groups_alive(vm.home, ids):
                    raise AssertionError("a partitioned attempt still ran after its job moved")
                return done
            finally:
                vm.unsilence()
        await asyncio.sleep(BLIP_S)
        vm.unsilence()
        await asyncio.sleep(RequeueConfig().node_lost_timeout_s + 8 - BLIP_S)
        return float(sum(attempt - 1 for _, _, attempt in await job_rows(db, ids)))
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await transport.close()
        await fleet.close()
        await db.dispose()
        nats.stop()
        await asyncio.to_thread(pg.stop)


async def main(trials: int) -> None:
    """Run the trials and print the figures."""
    configure("ERROR")  # the daemons log every outage they see; only figures here
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        for n in range(trials):
            for mode in MODES:
                results[mode].append(await trial(Path(tmp), n, mode))
            print(
                f"trial {n + 1}: VM crash->running elsewhere {results['crash'][-1]:.1f}s, "
                f"VM silent->running elsewhere {results['silent'][-1]:.1f}s, "
                f"10 s blip restarted {results['blip'][-1]:.0f} attempt(s)",
                flush=True,
            )
    crash = statistics.median(results["crash"])
    silent = statistics.median(results["silent"])
    restarts = int(sum(results["blip"]))
    knobs = Liveness()
    print(
        f"defaults: poll every {knobs.poll_interval_s:g}s (timeout {knobs.poll_timeout_s:g}s), "
        f"unreachable after {knobs.unreachable_timeout_s:g}s silent, node-lost after "
        f"{knobs.node_lost_timeout_s:g}s, fence after {knobs.fence_after_s:g}s + "
        f"{knobs.fence_grace_s:g}s grace; {trials} trial(s); max crash "
        f"{max(results['crash']):.1f}s, max silent {max(results['silent']):.1f}s; target "
        f"<= {TARGET_S:.0f}s: "
        f"{'met' if max(crash, silent) <= TARGET_S and restarts == 0 else 'MISSED'}"
    )
    print(f"recovery: crash_s={crash:.1f} silent_s={silent:.1f} blip_restarts={restarts}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one trial of each mode")
    args = parser.parse_args()
    asyncio.run(main(1 if args.quick else args.trials))
