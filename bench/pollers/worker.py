"""One poller of `bench/poll.py`, a process of its own: sweeps its share of the simulated
fleet and reports each sweep's wall and CPU time on stdout (JSON lines).

It imports `scheduler` from `--code` (default: this checkout), so the same benchmark can
measure another checkout's poller (`--code /path/to/other/checkout`, one poller, polling
every VM as a poller alone does). Driven by `bench/poll.py` over stdin: it prints `ready`
once its share is settled, sweeps once to connect on `warm`, sweeps `--sweeps` times on
`go`, and exits on `stop`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def line() -> str:
    return (await asyncio.to_thread(sys.stdin.readline)).strip()


async def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(args.code).resolve()))
    from scheduler.db import Database
    from scheduler.gpu_poller import GpuPoller
    from scheduler.logging import configure
    from scheduler.transport import SSHTransport

    configure("ERROR")  # a loaded machine makes some VMs late: not news here
    db = Database(args.url, pool_size=3)
    # Generous deadlines: a machine shared by the fleet's processes answers late at times,
    # and a poll counted as failed would be retried over a new connection (not the cost
    # being measured). Liveness is not what this measures.
    # Keepalives as the poller daemon has them (`gpu_poller.run`; today's poller had the
    # transport's default).
    keepalive = {}
    if args.pollers > 0:
        from scheduler.liveness import Liveness

        keepalive = {"keepalive_interval": Liveness().poll_keepalive_s()}
    transport = SSHTransport(
        max_concurrency=args.concurrency, connect_timeout=60.0, login_timeout=60.0, **keepalive
    )
    shares = None
    keeper = None
    if args.pollers > 0:
        from scheduler.gpu_poller.shares import Keeper, Shares

        shares = Shares(db, lease_s=args.lease, name=f"bench-poller-{args.index}")
        # Renewed as the daemon does: from a thread of its own.
        keeper = Keeper(shares, args.url)
        keeper.start()
        while shares.pollers != args.pollers or not shares.held:
            await asyncio.sleep(0.05)
        # Sweeps run back to back here, not every 5 s as in the daemon: GPU samples are
        # written every poll (0), more than the daemon's one in three (the upper bound).
        poller = GpuPoller(
            db, transport, shares=shares, gpu_sample_every_s=0.0, command_timeout=120.0
        )
    else:
        poller = GpuPoller(db, transport, command_timeout=120.0)
    import scheduler

    say(event="ready", held=len(shares.held) if shares else None, code=scheduler.__file__)
    assert await line() == "warm"

    async def sweep() -> dict[str, float]:
        cpu = time.process_time()
        wall = time.monotonic()
        stats = await poller.sweep()
        cpu = time.process_time() - cpu
        wall = time.monotonic() - wall
        polled = getattr(stats, "polled", stats.reachable + stats.failed)
        return {
            "wall": wall,
            "cpu": cpu,
            "vms": stats.vms,
            "polled": polled,
            "reachable": stats.reachable,
        }

    warm = await sweep()
    for _ in range(2):  # VMs a loaded machine did not connect in time: once more
        if warm["reachable"] == warm["vms"]:
            break
        warm = await sweep()
    say(event="warm", **warm)
    assert await line() == "go"
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    sweeps = [await sweep() for _ in range(args.sweeps)]
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    say(event="done", sweeps=sweeps, held=len(shares.held) if shares else None)
    assert await line() == "stop"
    if keeper is not None:
        keeper.stop()
    await transport.close()
    await db.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--code", default=str(REPO))
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--pollers", type=int, default=1, help="0: poll every VM, no shares")
    parser.add_argument("--sweeps", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--profile", default=None, help="cProfile the measured sweeps into it")
    args = parser.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(main(args))
