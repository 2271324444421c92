"""Benchmark: full poller sweeps over 1000 simulated VMs, against a naive sequential poll.

A separate process runs 1000 asyncssh servers on 127.0.0.1 (one port per VM, one shared
ed25519 host key). Every command (an exec, or a request to the poller's persistent shell) is
answered after 50 ms, standing for network distance,
with a 4-GPU nvidia-smi poll from memory (utilization and memory vary per answer, so the
poller really writes GPU rows every sweep). The real `GpuPoller` sweeps the fleet against
embedded Postgres with warm connections; the baseline opens a new SSH connection per VM
and polls VMs one after another (a sample of VMs, scaled to the fleet).

    .venv/bin/python bench/poll.py [--vms 1000] [--sweeps 5] [--baseline-sample 20]

Last line: `poll: vms=1000 sweep_s=<p50> baseline_s=<…> ratio=<baseline/sweep>`.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import multiprocessing as mp
import random
import re
import resource
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncssh  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from scheduler.db import Database  # noqa: E402
from scheduler.embedded import EmbeddedPostgres  # noqa: E402
from scheduler.gpu_poller import GpuPoller  # noqa: E402
from scheduler.logging import configure  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402
from scheduler.models import VM  # noqa: E402
from scheduler.poll import APPS, APPS_RC, END, GPUS, GPUS_RC, JOBS, parse_poll  # noqa: E402
from scheduler.ssh_channel import remote_timeout_wrapper  # noqa: E402
from scheduler.transport import SESSION_END, SSHTransport, VMTarget  # noqa: E402

LATENCY_S = 0.05
# The last line of a request to a persistent session (see scheduler.transport._Session).
END_OF_REQUEST = re.compile(rb"printf '\\n%s\\n' (" + SESSION_END.encode() + rb"[0-9a-f]+) >&2\n")
GPUS_PER_VM = 4
FAST = {
    "kex_algs": ["curve25519-sha256"],
    "encryption_algs": ["aes128-gcm@openssh.com", "chacha20-poly1305@openssh.com"],
}


def raise_fd_limit() -> None:
    """Each VM costs a socket on both sides: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the simulated fleet (its own process) ----------------------------------------------


def poll_answer(vm: int, rng: random.Random) -> bytes:
    """A healthy 4-GPU poll as a VM would print it, with varying load."""
    lines = [JOBS, GPUS]
    for i in range(GPUS_PER_VM):
        used = rng.randrange(0, 80000)
        lines.append(
            f"{i}, GPU-{vm:08x}-0000-4000-8000-{i:012x}, NVIDIA H100 80GB HBM3, 81559, "
            f"{used}, {rng.randrange(0, 101)}"
        )
    lines += [f"{GPUS_RC} 0", APPS, f"{APPS_RC} 0", END, ""]
    return "\n".join(lines).encode()


def fleet_main(n: int, host_key: bytes, client_pub: str, out: Connection) -> None:
    """Serve `n` VMs on consecutive listeners; send their ports through `out`."""
    raise_fd_limit()

    async def serve() -> None:
        key = asyncssh.import_private_key(host_key)
        authorized = asyncssh.import_authorized_keys(client_pub)
        rng = random.Random(7)

        def handler(vm: int):  # type: ignore[no-untyped-def]
            async def handle(process: asyncssh.SSHServerProcess[bytes]) -> None:
                if process.command != "sh":  # one command per channel (the baseline)
                    await asyncio.sleep(LATENCY_S)
                    process.stdout.write(poll_answer(vm, rng))
                    process.exit(0)
                    return
                # A persistent shell (the poller): answer each framed request in turn.
                buffer = b""
                while chunk := await process.stdin.read(65536):
                    buffer += chunk
                    while (match := END_OF_REQUEST.search(buffer)) is not None:
                        buffer = buffer[match.end() :]
                        await asyncio.sleep(LATENCY_S)
                        end = match.group(1)
                        process.stdout.write(poll_answer(vm, rng) + b"\n" + end + b" 0\n")
                        process.stderr.write(b"\n" + end + b"\n")
                process.exit(0)

            return handle

        servers = []
        for vm in range(n):
            servers.append(
                await asyncssh.create_server(
                    asyncssh.SSHServer,
                    "127.0.0.1",
                    0,
                    server_host_keys=[key],
                    authorized_client_keys=authorized,
                    process_factory=handler(vm),
                    encoding=None,
                    keepalive_interval=0,
                    **FAST,
                )
            )
        out.send([s.get_port() for s in servers])
        await asyncio.Event().wait()

    asyncio.run(serve())


# --- the benchmark ----------------------------------------------------------------------


async def register(db: Database, ports: list[int], key_path: Path, known_hosts: Path) -> None:
    """One VM row per simulated VM."""
    user = getpass.getuser()
    rows = [
        {
            "name": f"vm{i:04d}",
            "host": "127.0.0.1",
            "port": port,
            "user": user,
            "ssh_key_path": str(key_path),
            "known_hosts": str(known_hosts),
        }
        for i, port in enumerate(ports)
    ]
    async with db.transaction() as session:
        await session.execute(insert(VM), rows)


async def baseline(targets: list[VMTarget]) -> float:
    """Seconds to poll `targets` one after another, each over a brand-new connection."""
    started = time.perf_counter()
    for target in targets:
        async with asyncssh.connect(
            target.host,
            port=target.port,
            username=target.user,
            client_keys=[target.ssh_key_path],
            known_hosts=target.known_hosts,
            agent_path=None,
            **FAST,
        ) as conn:
            command = remote_timeout_wrapper("nvidia-smi …", 20)
            result = await conn.run(command, check=False)
            assert parse_poll(str(result.stdout)).error is None
    return time.perf_counter() - started


async def bench(args: argparse.Namespace, ports: list[int], keys: Path, url: str) -> str:
    db = Database(url, pool_size=4)
    await register(db, ports, keys / "id_ed25519", keys / "known_hosts")
    transport = SSHTransport(max_concurrency=args.concurrency)
    poller = GpuPoller(db, transport)
    try:
        started = time.perf_counter()
        warm = await poller.sweep()
        print(
            f"warm-up sweep (connects {warm.reachable}/{warm.vms} VMs): "
            f"{time.perf_counter() - started:.2f}s",
            flush=True,
        )
        assert warm.reachable == args.vms, f"only {warm.reachable} VMs answered"
        times = []
        for n in range(args.sweeps):
            stats = await poller.sweep()
            assert stats.reachable == args.vms and stats.unhealthy == 0, stats
            times.append(stats.seconds)
            print(f"sweep {n + 1}: {stats.seconds:.3f}s", flush=True)
        sweep = statistics.median(times)
    finally:
        await transport.close()
    sample = [
        VMTarget(
            id=i,
            name=f"vm{i:04d}",
            host="127.0.0.1",
            port=ports[i],
            user=getpass.getuser(),
            ssh_key_path=str(keys / "id_ed25519"),
            known_hosts=str(keys / "known_hosts"),
        )
        for i in range(0, args.vms, max(1, args.vms // args.baseline_sample))[
            : args.baseline_sample
        ]
    ]
    took = await baseline(sample)
    per_vm = took / len(sample)
    base = per_vm * args.vms
    print(f"baseline: {len(sample)} VMs in {took:.2f}s = {per_vm * 1000:.0f} ms/VM", flush=True)
    await db.dispose()
    return (
        f"poll: vms={args.vms} sweep_s={sweep:.3f} baseline_s={base:.1f} ratio={base / sweep:.0f}"
    )


def main() -> None:
    """Start Postgres and the fleet, run the benchmark, print the result line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=1000)
    parser.add_argument("--sweeps", type=int, default=5)
    parser.add_argument("--baseline-sample", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=200)
    args = parser.parse_args()
    raise_fd_limit()
    configure("WARNING")
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        keys = Path(tmp)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key.write_private_key(str(keys / "id_ed25519"))
        (keys / "id_ed25519").chmod(0o600)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        fleet = ctx.Process(
            target=fleet_main,
            args=(
                args.vms,
                host_key.export_private_key(),
                client_key.export_public_key("openssh").decode(),
                child,
            ),
            daemon=True,
        )
        fleet.start()
        postgres = EmbeddedPostgres(keys / "pg", durable=False)
        try:
            postgres.start()
            url = postgres.create_database("bench")
            upgrade(url)
            if not parent.poll(120):
                raise SystemExit("the simulated fleet did not start")
            ports: list[int] = parent.recv()
            public = host_key.export_public_key("openssh").decode().strip()
            (keys / "known_hosts").write_text(
                "".join(f"[127.0.0.1]:{port} {public}\n" for port in ports)
            )
            line = asyncio.run(bench(args, ports, keys, url))
        finally:
            fleet.terminate()
            fleet.join(10)
            postgres.stop()
    print(line)


if __name__ == "__main__":
    main()
