"""Benchmark: pollers sharing a simulated fleet, each a process of its own.

Simulated VMs are asyncssh servers on 127.0.0.1 (one port per VM, one shared ed25519 host
key), spread over `--fleet-procs` processes of their own. Every command (an exec, or a
request to the poller's persistent shell) is answered after 50 ms, standing for network
distance, with a 4-GPU nvidia-smi poll from memory (utilization and memory vary per
answer, so the poller really writes GPU rows every sweep); each fleet process counts the
polls each of its VMs answers.

For each count in `--pollers` (default 1,2,3), that many pollers (`bench/pollers/worker.py`,
the real `GpuPoller` with its lease, `scheduler.gpu_poller.shares`) start against one
embedded Postgres, divide the VMs, sweep once to connect, then sweep `--sweeps` times, all
at once. Printed per poller: the wall and CPU time of a sweep (median), the VMs it polled
per sweep and its CPU per VM-poll; per round: polls per VM per sweep as the fleet counted
them (exactly 1 when the division is right). With `--today DIR`, a first round runs the
poller of another checkout (one poller polling every VM, as before pollers shared) for the
CPU per VM-poll to compare with. On a machine with few cores the fleet processes compete
with the pollers for them: the figure that stands for pollers on separate hosts is each
poller's own CPU time per sweep.

    .venv/bin/python bench/poll.py [--vms 1000] [--pollers 1,2,3] [--sweeps 5]
        [--fleet-procs 4] [--today /path/to/checkout] [--baseline-sample 0]

Last line: `poll: vms=N pollers=P cpu_s_per_poller=<max median> polls_per_vm=<min>..<max> …`.
A sequential baseline (a new SSH connection per VM, one VM after another, over a sample
scaled to the fleet) runs with `--baseline-sample N` (N > 0).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import multiprocessing as mp
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import asyncssh  # noqa: E402
from sqlalchemy import create_engine, insert, pool, text  # noqa: E402

from scheduler.db import Database  # noqa: E402
from scheduler.embedded import EmbeddedPostgres  # noqa: E402
from scheduler.logging import configure  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402
from scheduler.models import VM  # noqa: E402
from scheduler.poll import APPS, APPS_RC, END, GPUS, GPUS_RC, JOBS, parse_poll  # noqa: E402
from scheduler.ssh_channel import remote_timeout_wrapper  # noqa: E402
from scheduler.transport import SESSION_END, VMTarget  # noqa: E402

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


def fleet_main(first: int, n: int, host_key: bytes, client_pub: str, out: Connection) -> None:
    """Serve VMs `first`…`first + n - 1` on consecutive listeners; send their ports through
    `out`, then answer each `count` request on it with the polls each VM answered."""
    raise_fd_limit()

    async def serve() -> None:
        key = asyncssh.import_private_key(host_key)
        authorized = asyncssh.import_authorized_keys(client_pub)
        rng = random.Random(7 + first)
        counts = [0] * n

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
                        counts[vm - first] += 1
                        await asyncio.sleep(LATENCY_S)
                        end = match.group(1)
                        process.stdout.write(poll_answer(vm, rng) + b"\n" + end + b" 0\n")
                        process.stderr.write(b"\n" + end + b"\n")
                process.exit(0)

            return handle

        servers = []
        for vm in range(first, first + n):
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
        loop = asyncio.get_running_loop()
        while True:
            request = await loop.run_in_executor(None, out.recv)
            if request == "count":
                out.send(list(counts))

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


class Worker:
    """One poller process (`bench/pollers/worker.py`), driven over its stdin and stdout."""

    def __init__(self, index: int, url: str, args: argparse.Namespace, pollers: int, code: str):
        self.index = index
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).parent / "pollers" / "worker.py"),
                "--url",
                url,
                "--code",
                code,
                "--index",
                str(index),
                "--pollers",
                str(pollers),
                "--sweeps",
                str(args.sweeps),
                "--concurrency",
                str(args.concurrency),
                "--lease",
                str(args.lease),
                *(
                    ["--profile", f"{args.profile}/poller-{pollers}-{index}.prof"]
                    if args.profile
                    else []
                ),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str) -> dict[str, Any]:
        """The next report of this kind (renewal failures are printed on the way)."""
        assert self.proc.stdout is not None
        while True:
            text = self.proc.stdout.readline()
            if not text:
                raise SystemExit(f"poller {self.index} exited ({self.proc.wait()})")
            report = json.loads(text)
            if report["event"] == event:
                return report
            print(f"  poller {self.index}: {report}", flush=True)


def show_profile(path: Path) -> None:
    """Where poller 0's measured sweeps spent their time (cProfile: the shares add to the
    Python-heavy parts), by own time and by cumulative time."""
    import pstats

    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)


def fleet_counts(fleet: list[Connection]) -> list[int]:
    """Polls answered so far by each VM, in VM order."""
    counts: list[int] = []
    for conn in fleet:
        conn.send("count")
        counts += conn.recv()
    return counts


def reset_shares(url: str) -> None:
    """No poller and no VM held: each round starts from scratch."""
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.begin() as conn:
        conn.execute(text("UPDATE vms SET poller_id = NULL"))
        conn.execute(text("DELETE FROM pollers"))
    engine.dispose()


def held_by(url: str) -> Counter[str | None]:
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.begin() as conn:
        rows = conn.execute(
            text("SELECT p.name FROM vms v LEFT JOIN pollers p ON p.id = v.poller_id")
        ).scalars()
        held = Counter(rows)
    engine.dispose()
    return held


def run_round(
    args: argparse.Namespace, url: str, fleet: list[Connection], pollers: int, code: str
) -> tuple[float, float, str]:
    """Run `pollers` pollers (0: one poller of `code` polling every VM, no shares);
    print their figures; (worst median CPU s per sweep, CPU ms per VM-poll, summary)."""
    label = f"{pollers} poller(s)" if pollers else f"today's poller ({code}), alone"
    print(f"--- {label} over {args.vms} VMs", flush=True)
    reset_shares(url)
    workers = [Worker(i, url, args, pollers, code) for i in range(max(1, pollers))]
    try:
        for w in workers:
            ready = w.expect("ready")
            assert ready["code"].startswith(str(Path(code).resolve())), ready
        if pollers:
            held = held_by(url)
            assert None not in held, f"VMs held by no poller: {held}"
            print(f"  division: {sorted(held.values())}", flush=True)
        for w in workers:
            w.send("warm")
        for w in workers:
            warm = w.expect("warm")
            print(
                f"  poller {w.index} warm-up sweep (connects {warm['reachable']}/{warm['vms']}): "
                f"{warm['wall']:.2f}s",
                flush=True,
            )
        before = fleet_counts(fleet)
        for w in workers:
            w.send("go")
        done = [w.expect("done") for w in workers]
        after = fleet_counts(fleet)
        for w in workers:
            w.send("stop")
        for w in workers:
            w.proc.wait(60)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    per_vm = [(b - a) / args.sweeps for a, b in zip(before, after, strict=True)]
    worst_cpu = 0.0
    cpu_total = 0.0
    polls_total = 0
    for w, report in zip(workers, done, strict=True):
        sweeps = report["sweeps"]
        assert all(s["reachable"] == s["vms"] for s in sweeps), sweeps
        wall = statistics.median(s["wall"] for s in sweeps)
        cpu = statistics.median(s["cpu"] for s in sweeps)
        polled = statistics.median(s["polled"] for s in sweeps)
        worst_cpu = max(worst_cpu, cpu)
        cpu_total += sum(s["cpu"] for s in sweeps)
        polls_total += sum(s["polled"] for s in sweeps)
        print(
            f"  poller {w.index}: sweep wall {wall:.2f}s cpu {cpu:.2f}s, "
            f"VMs polled {polled:.0f}, cpu/VM-poll {cpu / max(1, polled) * 1000:.2f} ms",
            flush=True,
        )
    per_poll_ms = cpu_total / max(1, polls_total) * 1000
    if args.profile:
        show_profile(Path(args.profile) / f"poller-{pollers}-0.prof")
    summary = (
        f"pollers={pollers or 'today'} cpu_s_per_poller={worst_cpu:.2f} "
        f"polls_per_vm={min(per_vm):g}..{max(per_vm):g} cpu_ms_per_vm_poll={per_poll_ms:.2f}"
    )
    print(f"  polls per VM per sweep: min {min(per_vm):g} max {max(per_vm):g}", flush=True)
    return worst_cpu, per_poll_ms, summary


def bench(
    args: argparse.Namespace, ports: list[int], keys: Path, url: str, fleet: list[Connection]
) -> str:
    db = Database(url, pool_size=2)
    asyncio.run(register(db, ports, keys / "id_ed25519", keys / "known_hosts"))
    asyncio.run(db.dispose())
    lines = []
    today_ms = None
    if args.today:
        _, today_ms, summary = run_round(args, url, fleet, 0, args.today)
        lines.append(summary)
    for n in args.pollers:
        _, per_poll_ms, summary = run_round(args, url, fleet, n, str(REPO))
        if today_ms:
            summary += f" vs_today={per_poll_ms / today_ms:.2f}x"
        lines.append(summary)
    if args.baseline_sample > 0:
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
        took = asyncio.run(baseline(sample))
        per_vm = took / len(sample)
        print(
            f"baseline: {len(sample)} VMs in {took:.2f}s = {per_vm * 1000:.0f} ms/VM, "
            f"{per_vm * args.vms:.1f}s for the fleet",
            flush=True,
        )
    print("\n".join(lines))
    return f"poll: vms={args.vms} " + " | ".join(lines)


def main() -> None:
    """Start Postgres and the fleet, run the rounds, print the result line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=1000)
    parser.add_argument("--pollers", default="1,2,3", help="comma-separated poller counts")
    parser.add_argument("--sweeps", type=int, default=5)
    parser.add_argument("--fleet-procs", type=int, default=4)
    parser.add_argument("--today", default=None, help="checkout whose poller to compare with")
    parser.add_argument("--baseline-sample", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=200)
    # No poller fails here: the lease sets only how often each renews (four times per
    # lease). Longer than the daemon's, so that a machine shared with the fleet processes
    # does not make a poller miss its renewals (`--lease 1.8` is the daemon's default).
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument(
        "--profile",
        default=None,
        help="directory: cProfile the measured sweeps there, print where the time goes",
    )
    args = parser.parse_args()
    args.pollers = [int(n) for n in args.pollers.split(",") if n.strip()]
    raise_fd_limit()
    configure("WARNING")
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        keys = Path(tmp)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key.write_private_key(str(keys / "id_ed25519"))
        (keys / "id_ed25519").chmod(0o600)
        ctx = mp.get_context("spawn")
        procs = []
        conns: list[Connection] = []
        per = -(-args.vms // args.fleet_procs)
        for first in range(0, args.vms, per):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=fleet_main,
                args=(
                    first,
                    min(per, args.vms - first),
                    host_key.export_private_key(),
                    client_key.export_public_key("openssh").decode(),
                    child,
                ),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            conns.append(parent)
        postgres = EmbeddedPostgres(keys / "pg", durable=False)
        try:
            postgres.start()
            url = postgres.create_database("bench")
            upgrade(url)
            ports: list[int] = []
            for conn in conns:
                if not conn.poll(300):
                    raise SystemExit("the simulated fleet did not start")
                ports += conn.recv()
            public = host_key.export_public_key("openssh").decode().strip()
            (keys / "known_hosts").write_text(
                "".join(f"[127.0.0.1]:{port} {public}\n" for port in ports)
            )
            line = bench(args, ports, keys, url, conns)
        finally:
            for proc in procs:
                proc.terminate()
                proc.join(10)
            postgres.stop()
    print(line)


if __name__ == "__main__":
    main()
