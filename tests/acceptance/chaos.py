"""Helpers of the chaos test: daemons as subprocesses, a sampler of the live training
processes, and the checks that no GPU was double-booked and no job ran twice.

Two independent witnesses are used. fake_train writes a record when it starts and when
it ends normally (RLFLEET_FAKE_RECORD); a process killed by a signal writes no end, so a
sampler scans /proc every few hundred milliseconds and remembers when it last saw each
training process alive. A run lasts from its start record to its end record, or else to
the last time the sampler saw it (or one sampling period, if it never did). A rank of a
multi-node job is one such process; two ranks of one attempt alive together are one run of
the job, never a duplicate.

A third witness audits the database itself: `AuditSampler` runs the gang-claim audits
(scheduler/gpus.py, `PARTIAL_CLAIMS_SQL` and `DOUBLE_BOOKED_SQL`) every few hundred
milliseconds while the chaos goes on, and remembers every instant either was not 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from sqlalchemy.exc import DBAPIError

from scheduler import bus
from scheduler.db import Database
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL

REPO = Path(__file__).resolve().parents[2]


# What a publish raises while nats-server is stopped, restarting or its JetStream not yet
# ready: the request times out or finds no responder, the client is closed or reconnecting
# (its buffer full), or JetStream answers 503. Any other error is a bug, not an outage.
NATS_DOWN: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


async def publish_unless_down(js: JetStreamContext, job_id: int, attempt: int) -> bool:
    """Publish a job as `rlfleet job submit` does. False when NATS is down (the job stays
    unannounced, for the requeue manager); any other error propagates and fails the test."""
    try:
        await bus.publish_job(js, job_id, dedupe_id=bus.msg_id(job_id, attempt))
    except NATS_DOWN:
        return False
    return True


class Daemon:
    """One rlfleet daemon as a subprocess (`python -m scheduler.<module> …`)."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start (or start again) the daemon, appending to its log."""
        self.starts += 1
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL, as a crash or the OOM killer would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM and wait (SIGKILL after `timeout`); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        """The end of the daemon's log, for failure messages."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Sighting:
    """One training process as the sampler saw it."""

    vm: str
    job_id: int
    attempt: int
    gpus: tuple[str, ...]
    pid: int
    first: float
    last: float
    rank: int = 0


@dataclass
class LiveSampler:
    """Scans /proc for the fleet's training processes and checks each instant: no two
    attempts of one job alive together, no rank of an attempt alive twice, no GPU of a VM
    named by two live runs.

    Only processes whose RLFLEET_FAKE_RECORD is `record_dir` count: other test runs on
    the same machine may use the same VM names."""

    vms: frozenset[str]
    record_dir: str
    period_s: float = 0.25
    seen: dict[tuple[int, int], Sighting] = field(default_factory=dict)
    duplicate_instants: list[str] = field(default_factory=list)
    double_booked_instants: list[str] = field(default_factory=list)
    scans: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Scan in a background thread until `stop()`."""
        self._thread = threading.Thread(target=self._loop, name="live-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scanning."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.scan()

    def scan(self) -> None:
        """One look at every process."""
        now = time.time()
        live: list[Sighting] = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            found = _training_process(int(entry), self.vms, self.record_dir, now)
            if found is not None:
                key, sighting = found
                known = self.seen.setdefault(key, sighting)
                known.last = now
                live.append(known)
        self.scans += 1
        attempts: dict[int, set[int]] = defaultdict(set)
        ranks: Counter[tuple[int, int, int]] = Counter()
        holders: dict[tuple[str, str], set[tuple[int, int]]] = defaultdict(set)
        for s in live:
            attempts[s.job_id].add(s.attempt)
            ranks[(s.job_id, s.attempt, s.rank)] += 1
            for gpu in s.gpus:
                holders[(s.vm, gpu)].add((s.job_id, s.attempt))
        for job_id, live_attempts in attempts.items():
            if len(live_attempts) > 1:
                self.duplicate_instants.append(f"job {job_id} attempts {sorted(live_attempts)}")
        for (job_id, attempt, rank), alive in ranks.items():
            if alive > 1:
                self.duplicate_instants.append(f"job {job_id}/{attempt} rank {rank} {alive}x")
        for (vm, gpu), runs in holders.items():
            if len(runs) > 1:
                self.double_booked_instants.append(f"{vm} GPU {gpu}: {sorted(runs)}")


def live_ranks(vms: frozenset[str], record_dir: str) -> list[Sighting]:
    """The fleet's training processes (every rank) alive right now."""
    now = time.time()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (hit := _training_process(int(entry), vms, record_dir, now)):
            found.append(hit[1])
    return found


class AuditSampler:
    """Runs the partial-claims and double-booking audits against the database every
    `period_s` until stopped, counting each rank of a gang (`job_nodes`) as its own holder.
    An instant when Postgres is down is skipped, and counted as such."""

    def __init__(self, url: str, period_s: float = 0.25) -> None:
        self.db = Database(url)
        self.period_s = period_s
        self.audits = 0
        self.skipped = 0
        self.partial_instants: list[str] = []
        self.double_booked_instants: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Audit in a task of the running event loop until `stop()`."""
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop auditing and close the connections."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.db.dispose()

    async def _loop(self) -> None:
        started = time.monotonic()
        while True:
            await self.audit(time.monotonic() - started)
            await asyncio.sleep(self.period_s)

    async def audit(self, at: float) -> None:
        """One look; each audit is one statement, so it sees one snapshot of the claims."""
        try:
            async with self.db.transaction() as session:
                partial = int(await session.scalar(PARTIAL_CLAIMS_SQL) or 0)
                double = int(await session.scalar(DOUBLE_BOOKED_SQL) or 0)
        except (DBAPIError, OSError):
            self.skipped += 1  # Postgres is being restarted
            return
        self.audits += 1
        if partial:
            self.partial_instants.append(f"t={at:.1f}s partial_claims={partial}")
        if double:
            self.double_booked_instants.append(f"t={at:.1f}s double_booked={double}")


def devices(visible: str) -> tuple[str, ...]:
    """The GPUs a `CUDA_VISIBLE_DEVICES` value names (UUIDs, as the scheduler sets it)."""
    return tuple(x.strip() for x in visible.split(",") if x.strip())


def _training_process(
    pid: int, vms: frozenset[str], record_dir: str, now: float
) -> tuple[tuple[int, int], Sighting] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    if stat[0] == b"Z":
        return None
    env = dict(v.split(b"=", 1) for v in raw.split(b"\0") if b"=" in v)
    vm = env.get(b"RLFLEET_SIM_VM", b"").decode()
    job = env.get(b"RLFLEET_JOB_ID", b"")
    if vm not in vms or not job.isdigit():
        return None
    if env.get(b"RLFLEET_FAKE_RECORD", b"").decode() != record_dir:
        return None
    gpus = devices(env.get(b"CUDA_VISIBLE_DEVICES", b"").decode())
    attempt = int(env.get(b"RLFLEET_ATTEMPT", b"0") or 0)
    rank = int(env.get(b"RLFLEET_NODE_RANK", b"0") or 0)
    start_ticks = int(stat[19])  # field 22: start time, tells a reused pid apart
    sighting = Sighting(vm, int(job), attempt, gpus, pid, now, now, rank)
    return (pid, start_ticks), sighting


@dataclass(frozen=True)
class Run:
    """One training process from start to end."""

    vm: str
    job_id: int
    attempt: int
    gpus: tuple[str, ...]
    pid: int
    start: float
    end: float
    rank: int = 0


def runs_from(records: Iterable[dict[str, Any]], sampler: LiveSampler) -> list[Run]:
    """Join start/end records with the sampler's sightings into runs."""
    last_seen: dict[tuple[str, int], float] = {}
    for s in sampler.seen.values():
        key = (s.vm, s.pid)
        last_seen[key] = max(last_seen.get(key, 0.0), s.last)
    starts: dict[tuple[str, int], dict[str, Any]] = {}
    ends: dict[tuple[str, int], float] = {}
    for r in records:
        key = (r["vm"], int(r["pid"]))
        if r["event"] == "start":
            starts[key] = r
        elif r["event"] == "end":
            ends[key] = float(r["t"])
    runs = []
    for key, r in starts.items():
        start = float(r["t"])
        end = ends.get(key) or max(last_seen.get(key, 0.0), start + sampler.period_s)
        gpus = devices(str(r["gpus"]))
        rank = int(r.get("node_rank") or 0)
        runs.append(
            Run(r["vm"], int(r["job_id"]), int(r["attempt"]), gpus, key[1], start, end, rank)
        )
    return runs


def overlapping(a: Run, b: Run) -> bool:
    """Whether two runs were alive at the same time."""
    return a.start < b.end and b.start < a.end


def double_booked(runs: Sequence[Run]) -> list[str]:
    """Pairs of runs of different jobs that held the same GPU of a VM at the same time."""
    by_gpu: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        for gpu in run.gpus:
            by_gpu[(run.vm, gpu)].append(run)
    found = []
    for (vm, gpu), held in by_gpu.items():
        held.sort(key=lambda r: r.start)
        for i, a in enumerate(held):
            for b in held[i + 1 :]:
                if b.start >= a.end:
                    break
                if (a.job_id, a.attempt) != (b.job_id, b.attempt):
                    found.append(
                        f"{vm} GPU {gpu}: job {a.job_id}/{a.attempt} and {b.job_id}/{b.attempt}"
                    )
    return found


def duplicate_runs(runs: Sequence[Run]) -> list[str]:
    """Jobs that had two processes alive at the same time (any attempts, any VMs), other
    than two different ranks of one attempt of a multi-node job."""
    by_job: dict[int, list[Run]] = defaultdict(list)
    for run in runs:
        by_job[run.job_id].append(run)
    found = []
    for job_id, own in by_job.items():
        own.sort(key=lambda r: r.start)
        for i, a in enumerate(own):
            for b in own[i + 1 :]:
                if a.attempt == b.attempt and a.rank != b.rank:
                    continue  # the ranks of one gang run together
                if overlapping(a, b):
                    found.append(
                        f"job {job_id}: attempt {a.attempt} rank {a.rank} on {a.vm} and "
                        f"{b.attempt} rank {b.rank} on {b.vm}"
                    )
    return found
