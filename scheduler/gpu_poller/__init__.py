"""The GPU poller: every few seconds, one SSH round trip per VM, all VMs at once.

A sweep is load → probe → apply (docs/invariants.md, invariant 4: no transaction is open during
SSH):
1. one short transaction reads every VM, its GPU rows and its live jobs;
2. every VM runs `poll.poll_command` concurrently (the transport bounds how many);
   the poll also renews the lease of each attempt it probes (the attempt's watchdog
   stops the training when its lease runs out: `remote.watchdog.watchdog_lines`);
3. as results come in, in batches (so writing overlaps the probes still out): finished
   jobs are moved (one short transaction each, GPUs freed in it), then one short
   transaction writes the batch's VM and GPU rows, one array statement per kind of write.
   A poll still out when the sweep's time is up is left running and recorded when it
   lands; a VM silent for `--unreachable-timeout` seconds is marked unreachable meanwhile.

It never frees or steals a GPU a job holds: only a job's end frees its GPUs, and a GPU is
offered only when healthy, unallocated and used by no process (`foreign_busy`). GPUs are
known by UUID: a renumbered GPU keeps its row and its job, and a GPU nvidia-smi no longer
lists is marked unhealthy, never replaced by the card that now has its index
(docs/invariants.md, invariant 8).

What a probed attempt's state means for its job (complete, fail and why, leave it) is
decided without I/O in `scheduler.verdicts`.

Run it as `rlfleet poller` or `python -m scheduler.gpu_poller`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import case, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.attempts.outcome import succeeded
from scheduler.attempts.ranks import exit_codes, job_shape
from scheduler.daemon import run_loop
from scheduler.db import Database, installation_id
from scheduler.gpus import RECOUNT_SQL
from scheduler.history import (
    PRUNE_EVERY_S,
    GpuReading,
    ProgressRow,
    history_days,
    prune,
    record_samples,
)
from scheduler.leftovers import AttemptRecord, abandon_attempt
from scheduler.liveness import UNREACHABLE_AFTER_POLLS, Liveness
from scheduler.logging import get_logger
from scheduler.models import GPU, VM, Job, JobNode
from scheduler.poll import PollResult, parse_poll, poll_command
from scheduler.remote.launch import entry_check_words
from scheduler.remote.layout import stored_attempt
from scheduler.settings import Settings
from scheduler.states import LIVE_STATES, JobStatus, VMStatus
from scheduler.transport import Transport, TransportError, VMTarget, make_transport
from scheduler.verdicts import JobVerdict, LiveJob, job_verdict, untracked_verdict

log = get_logger("gpu_poller")

ACTOR = "poller"
DEFAULT_INTERVAL_S = Liveness.poll_interval_s
DEFAULT_UNREACHABLE_AFTER = UNREACHABLE_AFTER_POLLS
DEFAULT_COMMAND_TIMEOUT_S = Liveness.poll_timeout_s
DEFAULT_UNREACHABLE_TIMEOUT_S = Liveness.unreachable_timeout_s
FLUSH_AFTER_S = 0.2
SILENT_CHECK_S = 1.0
"""While polls are out, how often the sweep checks whether their VMs have been silent for
the unreachable timeout (a poll on a frozen connection may not fail for a while)."""
"""Results that came in are written at the latest this long after the first of them, so
the VMs that answer are recorded at once, whatever a silent one does."""
UNHEALTHY = VMStatus.UNHEALTHY.value
"""`vms.status` of a VM that answers SSH but whose GPUs cannot be trusted (nvidia-smi failed)."""


# --- the sweep --------------------------------------------------------------------------


@dataclass
class GpuRow:
    """A GPU row as loaded; rows are keyed by UUID (docs/invariants.md, invariant 8)."""

    uuid: str
    job_id: int | None
    values: tuple[Any, ...]
    """(index, name, memory_total_mb, memory_used_mb, utilization_pct, healthy, foreign_busy)"""


@dataclass
class VMState:
    """One VM as loaded at the start of a sweep."""

    target: VMTarget
    status: str
    consecutive_failures: int
    launch_error: str | None = None
    gpus: dict[str, GpuRow] = field(default_factory=dict)
    """By UUID."""
    jobs: list[LiveJob] = field(default_factory=list)


@dataclass
class Outcome:
    """What probing one VM gave: a parsed poll, or the transport error."""

    vm: VMState
    result: PollResult | None = None
    error: str | None = None
    finished: set[int] = field(default_factory=set)
    """Jobs on this VM that the sweep moved to an end state (their GPUs freed)."""
    launch_error: str | None = None
    """Why training cannot start on the VM, as an attempt that ended this sweep said."""


@dataclass
class SweepStats:
    """Counts of one sweep, for logs and tests."""

    vms: int = 0
    reachable: int = 0
    unhealthy: int = 0
    failed: int = 0
    jobs_finished: int = 0
    silent: int = 0
    """VMs whose poll was still out when the sweep ended."""
    seconds: float = 0.0


# Each statement takes whole columns as arrays (unnest): one statement and one round trip
# for the whole fleet, instead of one per VM or per GPU.
_VM_OK_SQL = text(
    """
UPDATE vms SET
    -- A poll that neither ran the python check nor saw an attempt fail to start knows
    -- nothing of launch_error: what a concurrent apply wrote meanwhile stays.
    status = CASE WHEN NOT t.decides AND vms.launch_error IS NOT NULL THEN 'unhealthy'
                  ELSE t.status END,
    last_error = CASE WHEN NOT t.decides AND vms.launch_error IS NOT NULL THEN vms.last_error
                      ELSE t.error END,
    launch_error = CASE WHEN t.decides THEN t.launch_error ELSE vms.launch_error END,
    consecutive_failures = 0, unreachable_since = NULL, last_polled_at = now(),
    last_seen_at = now()
FROM unnest(CAST(:ids AS int[]), CAST(:statuses AS text[]), CAST(:errors AS text[]),
            CAST(:launch_errors AS text[]), CAST(:decides AS boolean[]))
    AS t(id, status, error, launch_error, decides)
WHERE vms.id = t.id
"""
)
# Written with the failed job, so that no claim lands on the VM before the sweep's end.
_VM_LAUNCH_BROKEN_SQL = text(
    """
UPDATE vms SET launch_error = :error, last_error = :error, status = 'unhealthy'
WHERE id = :vm_id
"""
)
# A VM is unreachable after `after` failed polls in a row (it refuses connections) or
# once it has not answered for `silent` seconds (its polls hang instead of failing). It has
# been unreachable since it last answered: the node-lost timeout counts from there.
_VM_FAIL_SQL = text(
    """
UPDATE vms SET consecutive_failures = consecutive_failures + 1, last_polled_at = now(),
    last_error = t.error,
    unreachable_since = COALESCE(unreachable_since, LEAST(last_seen_at, now()), now()),
    status = CASE WHEN consecutive_failures + 1 >= :after
                    OR last_seen_at < now() - make_interval(secs => :silent)
                  THEN 'unreachable' ELSE status END
FROM unnest(CAST(:ids AS int[]), CAST(:errors AS text[])) AS t(id, error)
WHERE vms.id = t.id
"""
)
# A VM whose poll is still out when the sweep ends: unreachable once silent long enough.
_VM_SILENT_SQL = text(
    """
UPDATE vms SET status = 'unreachable', last_error = :error,
    unreachable_since = COALESCE(unreachable_since, LEAST(last_seen_at, now()), now())
WHERE id = ANY(:ids) AND status <> 'unreachable'
  AND last_seen_at < now() - make_interval(secs => :silent)
RETURNING id
"""
)
# A GPU allocated to a job when the row is written is not foreign-busy: its processes are
# the job's. The CASE reads the row's job_id at write time, not at load time. Rows are
# matched by UUID, so a renumbered GPU keeps its row and its allocation; the index is
# updated as information (docs/invariants.md, invariant 8).
_GPU_UPSERT_SQL = text(
    """
INSERT INTO gpus (vm_id, index, uuid, name, memory_total_mb, memory_used_mb,
                  utilization_pct, healthy, foreign_busy, updated_at)
SELECT t.vm_id, t.idx, t.u, t.n, t.total, t.used, t.util, true, t.fb, now()
FROM unnest(CAST(:vm_ids AS int[]), CAST(:idxs AS int[]), CAST(:uuids AS text[]),
            CAST(:names AS text[]), CAST(:totals AS int[]), CAST(:useds AS int[]),
            CAST(:utils AS int[]), CAST(:fbs AS boolean[]))
    AS t(vm_id, idx, u, n, total, used, util, fb)
ON CONFLICT (vm_id, uuid) DO UPDATE SET
    index = excluded.index, name = excluded.name,
    memory_total_mb = excluded.memory_total_mb,
    memory_used_mb = excluded.memory_used_mb, utilization_pct = excluded.utilization_pct,
    healthy = true,
    foreign_busy = CASE WHEN gpus.job_id IS NULL THEN excluded.foreign_busy ELSE false END,
    updated_at = now()
"""
)
# A GPU nvidia-smi no longer lists (or cannot be trusted) keeps its row and its job: its
# allocation is never handed to whatever card now has its index.
_GPU_UNHEALTHY_SQL = text(
    """
UPDATE gpus SET healthy = false, updated_at = now()
FROM unnest(CAST(:vm_ids AS int[]), CAST(:uuids AS text[])) AS t(vm_id, u)
WHERE gpus.vm_id = t.vm_id AND gpus.uuid = t.u
"""
)
_GPUS_OF_UNREACHABLE_SQL = text(
    """
UPDATE gpus SET healthy = false, updated_at = now()
WHERE healthy AND vm_id = ANY(:ids)
  AND vm_id IN (SELECT id FROM vms WHERE status = 'unreachable')
"""
)


def _decides_launch_error(outcome: Outcome) -> bool:
    """Whether this poll's answer settles the VM's launch_error: an attempt ending in it
    could not start, or it ran the check of python and entrypoint (which a poll sent
    before the VM was marked does not: its apply must not undo the mark)."""
    result = outcome.result
    if outcome.launch_error is not None:
        return True
    return outcome.vm.launch_error is not None and result is not None and result.check is not None


class GpuPoller:
    """Sweeps the fleet: GPU rows, VM health, and the end of launched jobs.

    A VM's poll that is still out when a sweep ends is not waited for: it goes on (bounded
    by `command_timeout` and the transport's deadlines), the next sweeps leave that VM
    alone until it lands, and its result is recorded by whichever sweep sees it land. So
    one silent VM never slows the sweep of the others.
    """

    def __init__(
        self,
        db: Database,
        transport: Transport,
        *,
        unreachable_after: int = DEFAULT_UNREACHABLE_AFTER,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT_S,
        batch_size: int = 250,
        history_days: float | None = None,
    ) -> None:
        self.db = db
        self.history_days = history_days
        """Samples older than this many days are pruned; None: never."""
        self._pruned_at: float | None = None
        self.batch_size = batch_size
        self.transport = transport
        self.unreachable_after = max(1, unreachable_after)
        self.command_timeout = command_timeout
        self.unreachable_timeout = unreachable_timeout
        self._inflight: dict[int, asyncio.Task[Outcome]] = {}
        self._sent_at: dict[int, float] = {}
        self._failing: set[int] = set()
        """VMs whose latest poll failed."""
        self._landed: asyncio.Queue[Outcome] = asyncio.Queue()

    @property
    def in_flight(self) -> list[int]:
        """Ids of the VMs whose poll is still out."""
        return list(self._inflight)

    async def sweep(self, *, wait_s: float | None = None) -> SweepStats:
        """Poll every VM once and record what was seen.

        `wait_s`: wait at most this long for the polls (the daemon passes its interval);
        polls still out then are left running. None waits until every poll has landed."""
        started = time.monotonic()
        vms = await self._load()
        stats = SweepStats(vms=len(vms))
        for vm in vms:
            if vm.target.id not in self._inflight:
                self._start_probe(vm)
        deadline = None if wait_s is None else started + wait_s
        names = {vm.target.id: vm.target.name for vm in vms}
        # Results are written as they land, in batches (a flush at most FLUSH_AFTER_S after
        # the first waiting one), while the other polls are still out. Meanwhile, every
        # SILENT_CHECK_S, VMs whose poll is out or failed are marked unreachable once they
        # have been silent for the unreachable timeout; with a deadline, the sweep keeps
        # doing so until it ends while some VM is failing.
        pending: list[Outcome] = []
        first_at = 0.0
        next_check = started
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + SILENT_CHECK_S
                suspects = self._failing | {
                    i for i in self._inflight if now - self._sent_at[i] >= SILENT_CHECK_S
                }
                if suspects:
                    await self._mark_silent(sorted(suspects), names)
                continue
            if deadline is not None and now >= deadline:
                break
            quiet = not self._inflight and self._landed.empty() and not pending
            if quiet and (deadline is None or not self._failing):
                break
            waits = [next_check - now]
            if deadline is not None:
                waits.append(deadline - now)
            if pending:
                waits.append(max(0.0, first_at + FLUSH_AFTER_S - now))
            got = await _next(self._landed, min(waits))
            if got is not None:
                if not pending:
                    first_at = time.monotonic()
                pending.append(got)
                while not self._landed.empty() and len(pending) < self.batch_size:
                    pending.append(self._landed.get_nowait())
            due = time.monotonic() >= first_at + FLUSH_AFTER_S or not self._inflight
            if pending and (len(pending) >= self.batch_size or due or got is None):
                await self._record(pending, stats)
                pending = []
        while not self._landed.empty():
            pending.append(self._landed.get_nowait())
        if pending:
            await self._record(pending, stats)
        if self._inflight:
            stats.silent = len(self._inflight)
            await self._mark_silent(list(self._inflight), names)
        await self.prune_history()
        stats.seconds = time.monotonic() - started
        metrics.observe_poll_sweep(stats.seconds)
        log.debug("poll_sweep_done", **stats.__dict__)
        return stats

    def _start_probe(self, vm: VMState) -> None:
        task = asyncio.create_task(self._probe(vm))
        vm_id = vm.target.id
        self._inflight[vm_id] = task
        self._sent_at[vm_id] = time.monotonic()

        def landed(done: asyncio.Task[Outcome]) -> None:
            if self._inflight.get(vm_id) is done:
                del self._inflight[vm_id]
                self._sent_at.pop(vm_id, None)
            if not done.cancelled() and done.exception() is None:
                self._landed.put_nowait(done.result())

        task.add_done_callback(landed)

    async def close(self) -> None:
        """Cancel the polls still out (the daemon is stopping)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight.clear()

    async def prune_history(self, *, force: bool = False) -> int:
        """Delete the samples older than the retention, at most once per `PRUNE_EVERY_S`
        (or now, with `force`), in a short transaction of its own; how many went."""
        now = time.monotonic()
        if self.history_days is None:
            return 0
        if not force and self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return 0
        self._pruned_at = now
        async with self.db.transaction() as session:
            deleted = await prune(session, self.history_days)
        if deleted:
            log.info("history_pruned", rows=deleted, days=self.history_days)
        return deleted

    async def _mark_silent(self, vm_ids: list[int], names: dict[int, str]) -> None:
        """VMs whose poll is still out: unreachable once they have been silent long enough
        (the poll itself fails only at its timeout, or never on a frozen connection)."""
        error = f"no answer for over {self.unreachable_timeout:g}s (poll still waiting)"
        async with self.db.transaction() as session:
            marked = (
                (
                    await session.execute(
                        _VM_SILENT_SQL,
                        {"ids": vm_ids, "silent": self.unreachable_timeout, "error": error},
                    )
                )
                .scalars()
                .all()
            )
            if marked:
                await session.execute(_GPUS_OF_UNREACHABLE_SQL, {"ids": list(marked)})
                await session.execute(RECOUNT_SQL, {"ids": list(marked)})
        for vm_id in marked:
            log.warning("vm_unreachable", vm=names.get(vm_id, vm_id), error=error)

    async def _record(self, outcomes: Sequence[Outcome], stats: SweepStats) -> None:
        outcomes = latest_per_vm(outcomes)
        for outcome in outcomes:
            if outcome.result is None:
                self._failing.add(outcome.vm.target.id)
            else:
                self._failing.discard(outcome.vm.target.id)
        stats.jobs_finished += await self._finish_jobs(outcomes)
        await self._apply(outcomes, stats)

    async def _load(self) -> list[VMState]:
        async with self.db.transaction() as session:
            # Plain columns, not ORM objects: this runs for every VM on every sweep.
            vms = await _load_vms(session)
            installation = await installation_id(session)
            for job in await _load_ranks(session, installation):
                if job.vm_id in vms:
                    vms[job.vm_id].jobs.append(job)
        return list(vms.values())

    async def _probe(self, vm: VMState) -> Outcome:
        check = None
        if vm.launch_error is not None:
            # Until its python and entrypoint work again, every poll checks them.
            check = " ".join(entry_check_words(vm.target.python, vm.target.entrypoint))
        command = poll_command([j.run for j in vm.jobs if j.run is not None], check)
        try:
            # persistent: a poll every few seconds is worth a shell kept open on the VM.
            result = await self.transport.run(
                vm.target, command, timeout=self.command_timeout, persistent=True
            )
            return Outcome(vm, result=parse_poll(result.stdout))
        except TransportError as exc:
            return Outcome(vm, error=str(exc))
        except Exception as exc:  # a bug or an odd answer must not stop the sweep
            log.exception("poll_probe_crashed", vm=vm.target.name)
            return Outcome(vm, error=f"poll failed: {type(exc).__name__}: {exc}")

    async def _finish_jobs(self, outcomes: Sequence[Outcome]) -> int:
        finished = 0
        for outcome in outcomes:
            if outcome.result is None:
                continue
            for job in outcome.vm.jobs:
                if job.run is None:
                    verdict = untracked_verdict(job)
                else:
                    verdict = job_verdict(job, outcome.result.jobs.get((job.id, job.attempt)))
                if verdict is not None and await self._finish(outcome.vm, verdict):
                    outcome.finished.add(job.id)
                    outcome.launch_error = verdict.vm_error or outcome.launch_error
                    finished += 1
        return finished

    async def _finish(self, vm: VMState, verdict: JobVerdict) -> bool:
        job = verdict.job
        async with self.db.transaction() as session:
            moved = await finish_rank(session, verdict, vm.target.name)
            if moved and verdict.vm_error is not None:
                await session.execute(
                    _VM_LAUNCH_BROKEN_SQL, {"vm_id": vm.target.id, "error": verdict.vm_error}
                )
        if moved and verdict.vm_error is not None:
            log.warning("vm_cannot_launch", vm=vm.target.name, error=verdict.vm_error)
        if moved:
            log.info(
                "job_finished",
                job_id=job.id,
                vm=vm.target.name,
                attempt=job.attempt,
                status=verdict.to.value,
                exit_code=verdict.exit_code,
                failure_reason=verdict.failure_reason,
            )
            if verdict.failure_reason is not None:
                metrics.count_failure(verdict.failure_reason.value)
        return moved

    async def _apply(self, outcomes: Sequence[Outcome], stats: SweepStats) -> None:
        ok: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        upserts: list[dict[str, Any]] = []
        lost_gpus: list[dict[str, Any]] = []
        samples: list[GpuReading] = []
        progress: list[ProgressRow] = []
        for outcome in outcomes:
            vm, result = outcome.vm, outcome.result
            if result is None:
                failed.append({"vm_id": vm.target.id, "error": outcome.error})
                self._log_failure(vm, outcome.error or "")
                continue
            stats.reachable += 1
            progress += _progress_rows(outcome.vm, result)
            launch_error, launch_line = self._launch_error(outcome)
            decides = _decides_launch_error(outcome)
            if result.error is not None:
                stats.unhealthy += 1
                ok.append(
                    {
                        "vm_id": vm.target.id,
                        "status": UNHEALTHY,
                        "error": result.error,
                        "launch_error": launch_error,
                        "decides": decides,
                    }
                )
                lost_gpus += [{"vm_id": vm.target.id, "uuid": u} for u in vm.gpus]
                if vm.status != UNHEALTHY:
                    log.warning("vm_unhealthy", vm=vm.target.name, error=result.error)
                continue
            # GPUs fine, but a VM whose python or entrypoint cannot run gets no jobs.
            status = VMStatus.HEALTHY.value if launch_error is None else UNHEALTHY
            ok.append(
                {
                    "vm_id": vm.target.id,
                    "status": status,
                    "error": launch_line,
                    "launch_error": launch_error,
                    "decides": decides,
                }
            )
            if launch_error is not None:
                stats.unhealthy += 1
            elif vm.status != VMStatus.HEALTHY:
                log.info("vm_healthy", vm=vm.target.name, was=vm.status)
            upserts += _gpu_changes(vm, result, outcome.finished)
            samples += [
                GpuReading(
                    vm.target.id, g.uuid, g.utilization_pct, g.memory_used_mb, g.memory_total_mb
                )
                for g in result.gpus
            ]
            seen = {g.uuid for g in result.gpus}
            gone = [u for u, row in vm.gpus.items() if u not in seen and row.values[5]]
            if gone:
                log.warning("gpus_absent", vm=vm.target.name, uuids=gone)
            lost_gpus += [{"vm_id": vm.target.id, "uuid": u} for u in gone]
        stats.failed += len(failed)
        ids = [o.vm.target.id for o in outcomes]
        async with self.db.transaction() as session:
            if ok:
                await session.execute(
                    _VM_OK_SQL,
                    _columns(
                        ok,
                        ids="vm_id",
                        statuses="status",
                        errors="error",
                        launch_errors="launch_error",
                        decides="decides",
                    ),
                )
            if failed:
                await session.execute(
                    _VM_FAIL_SQL,
                    {
                        **_columns(failed, ids="vm_id", errors="error"),
                        "after": self.unreachable_after,
                        "silent": self.unreachable_timeout,
                    },
                )
                await session.execute(
                    _GPUS_OF_UNREACHABLE_SQL, {"ids": [f["vm_id"] for f in failed]}
                )
            if upserts:
                await session.execute(
                    _GPU_UPSERT_SQL,
                    _columns(
                        upserts,
                        vm_ids="vm_id",
                        idxs="index",
                        uuids="uuid",
                        names="name",
                        totals="total",
                        useds="used",
                        utils="util",
                        fbs="foreign",
                    ),
                )
            if lost_gpus:
                await session.execute(
                    _GPU_UNHEALTHY_SQL, _columns(lost_gpus, vm_ids="vm_id", uuids="uuid")
                )
            if ids:
                await session.execute(RECOUNT_SQL, {"ids": ids})
            # After the upserts: a GPU seen for the first time has its row by now.
            await record_samples(session, progress, samples)

    @staticmethod
    def _launch_error(outcome: Outcome) -> tuple[str | None, str | None]:
        """Why training cannot start on the VM after this poll, and the error line to show:
        what an attempt ending this sweep said, else the stored reason (with what the
        poll's check of python and entrypoint said) until that check passes."""
        vm, result = outcome.vm, outcome.result
        if outcome.launch_error is not None:
            return outcome.launch_error, outcome.launch_error
        if vm.launch_error is None or result is None or result.check is None:
            # No trouble, or the check's answer was cut off: ask again next poll.
            return vm.launch_error, vm.launch_error
        rc, line = result.check
        if rc == 0:
            log.info("vm_launch_check_passed", vm=vm.target.name, was=vm.launch_error)
            return None, None
        return vm.launch_error, f"{vm.launch_error} (check: exit {rc}: {line})"[:500]

    def _log_failure(self, vm: VMState, error: str) -> None:
        failures = vm.consecutive_failures + 1
        if failures >= self.unreachable_after and vm.status != VMStatus.UNREACHABLE:
            log.warning("vm_unreachable", vm=vm.target.name, failures=failures, error=error)
        else:
            log.info("vm_poll_failed", vm=vm.target.name, failures=failures, error=error)


def latest_per_vm(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """One outcome per VM, the last to land. A poll that one sweep left running lands in
    the next sweep's batch beside that sweep's own poll of the same VM (a VM's next poll
    starts only once the previous one landed, so the later is the newer), and the batch's
    GPU upsert may touch each row once."""
    return list({outcome.vm.target.id: outcome for outcome in outcomes}.values())


async def _next(queue: asyncio.Queue[Outcome], timeout: float | None) -> Outcome | None:
    """The next landed poll, or None when `timeout` passes first."""
    if not queue.empty():
        return queue.get_nowait()
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except TimeoutError:
        return None


def _columns(rows: Sequence[dict[str, Any]], **names: str) -> dict[str, list[Any]]:
    """Rows as columns: `names` maps each bind parameter to the row key it collects."""
    return {param: [row[key] for row in rows] for param, key in names.items()}


def _progress_rows(vm: VMState, result: PollResult) -> list[ProgressRow]:
    """The progress the poll read of the attempts this VM runs (a line for any other
    attempt is not this sweep's to record)."""
    wanted = {(j.id, j.attempt) for j in vm.jobs}
    return [
        ProgressRow(key[0], key[1], state.progress.step, state.progress.reward, state.progress.loss)
        for key, state in result.jobs.items()
        if key in wanted and state.progress is not None
    ]


def _gpu_changes(
    vm: VMState, result: PollResult, finished: Collection[int] = ()
) -> list[dict[str, Any]]:
    """Upsert parameters for the GPUs whose reported values differ from their rows.

    `finished`: jobs this sweep found ended (and freed). Their attempts had ended before
    nvidia-smi ran, so a process still on their GPUs is foreign."""
    busy = result.busy_uuids()
    rows = []
    for gpu in result.gpus:
        loaded = vm.gpus.get(gpu.uuid)
        # Processes on a GPU allocated to a live job are that job's.
        owned = loaded is not None and loaded.job_id is not None and loaded.job_id not in finished
        foreign = gpu.uuid in busy and not owned
        values = (
            gpu.index,
            gpu.name,
            gpu.memory_total_mb,
            gpu.memory_used_mb,
            gpu.utilization_pct,
            True,
            foreign,
        )
        if loaded is not None and loaded.values == values:
            continue
        rows.append(
            {
                "vm_id": vm.target.id,
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "total": gpu.memory_total_mb,
                "used": gpu.memory_used_mb,
                "util": gpu.utilization_pct,
                "foreign": foreign,
            }
        )
    return rows


async def _load_vms(session: AsyncSession) -> dict[int, VMState]:
    """Every VM with its GPU rows, by id."""
    vm_rows = await session.execute(
        select(*VMTarget.columns(), VM.status, VM.consecutive_failures, VM.launch_error)
    )
    vms = {
        row.id: VMState(
            VMTarget.from_row(row), row.status, row.consecutive_failures, row.launch_error
        )
        for row in vm_rows
    }
    gpu_rows = await session.execute(
        select(
            GPU.vm_id,
            GPU.uuid,
            GPU.job_id,
            GPU.index,
            GPU.name,
            GPU.memory_total_mb,
            GPU.memory_used_mb,
            GPU.utilization_pct,
            GPU.healthy,
            GPU.foreign_busy,
        )
    )
    for vm_id, uuid, job_id, *values in gpu_rows:
        if vm_id in vms:
            vms[vm_id].gpus[uuid] = GpuRow(uuid, job_id, tuple(values))
    return vms


async def _load_ranks(session: AsyncSession, installation: str) -> list[LiveJob]:
    """Every rank of every live attempt (`job_nodes`, one row per VM, rank 0 and
    single-node jobs included), each to be probed (and its lease renewed) on its own VM
    like any other. A live row that no claim placed (written by hand or by a bug: no
    `job_nodes` rows for its attempt) is read as its rank 0 from the job row, so that the
    probe resolves it like any other attempt (docs/security.md)."""
    placed = (JobNode.job_id == Job.id) & (JobNode.attempt == Job.attempt)
    unplaced = JobNode.job_id.is_(None)

    def column(of_rank: Any, of_job: Any, name: str) -> Any:
        return case((unplaced, of_job), else_=of_rank).label(name)

    vm_id = column(JobNode.vm_id, Job.vm_id, "vm_id")
    rows = await session.execute(
        select(
            Job.id,
            Job.status,
            Job.attempt,
            Job.launch_token,
            Job.nodes,
            column(JobNode.rank, 0, "rank"),
            vm_id,
            column(JobNode.remote_pid, Job.remote_pid, "remote_pid"),
            column(JobNode.attempt_dir, Job.attempt_dir, "attempt_dir"),
        )
        .outerjoin(JobNode, placed)
        .where(
            Job.status.in_([s.value for s in LIVE_STATES]),
            Job.attempt >= 1,
            case((unplaced, Job.vm_id), else_=JobNode.vm_id).is_not(None),
        )
    )
    return [
        LiveJob(
            row.id,
            row.vm_id,
            row.status,
            row.attempt,
            row.remote_pid,
            stored_attempt(installation, row.id, row.attempt, row.launch_token, row.attempt_dir),
            rank=row.rank,
            nodes=row.nodes,
        )
        for row in rows
    ]


async def finish_rank(session: AsyncSession, verdict: JobVerdict, vm_name: str) -> bool:
    """One rank of a live attempt ended (caller's transaction): the one way the poller
    finishes every kind of attempt (one VM, several VMs, a group), rank 0 like any other.

    The rank's end is noted on its `job_nodes` row (`job show` says which rank ended it,
    and how). A rank that exited 0 completes the job once the attempt has succeeded by the
    one outcome rule (`attempts.outcome`: every primary rank exited 0); a rank that failed
    fails the whole attempt (shared fate). Either way the attempt is abandoned
    (`leftovers.abandon_attempt`): the ranks known to have ended are done, every other rank
    that may still run (a group's service ranks, the other ranks of a failed attempt)
    becomes a leftover to kill, and the job's GPUs are freed; a single-node attempt has no
    other rank, so its GPUs are simply freed. Returns whether the job moved (False also
    when it is no longer that attempt: moved by someone else, or requeued and relaunched
    since the probe)."""
    job = verdict.job
    done = verdict.to == JobStatus.COMPLETED
    code = 0 if done else verdict.exit_code
    if code is not None:
        await session.execute(
            update(JobNode)
            .where(
                JobNode.job_id == job.id, JobNode.rank == job.rank, JobNode.attempt == job.attempt
            )
            .values(exit_code=code)
        )
    record = await _attempt_record(session, job)
    if record is None:
        return False
    if done:
        codes = await exit_codes(session, job.id, job.attempt)
        codes.setdefault(job.rank, 0)  # seen exiting 0, whether or not a row records it
        shape = await job_shape(session, job.id)
        if shape is None or not succeeded(shape, codes):
            return False
        ended = {rank for rank, c in codes.items() if c is not None}
        return await abandon_attempt(
            session,
            record,
            expected=LIVE_STATES,
            to=JobStatus.COMPLETED,
            reason=verdict.reason,
            actor=ACTOR,
            leftover="group_done",  # only a group's service ranks can be left running
            ended=ended,
            values={
                "exit_code": 0,
                "failure_reason": None,
                "status_reason": verdict.reason,
                "completed_attempt": job.attempt,
            },
        )
    reason = verdict.reason if job.nodes == 1 else f"rank {job.rank} on {vm_name}: {verdict.reason}"
    return await abandon_attempt(
        session,
        record,
        expected=LIVE_STATES,
        to=JobStatus.FAILED,
        reason=reason[:500],
        actor=ACTOR,
        leftover="rank_failed",
        ended={job.rank},
        failure_reason=verdict.failure_reason.value if verdict.failure_reason else None,
        values={"exit_code": verdict.exit_code},
    )


async def _attempt_record(session: AsyncSession, job: LiveJob) -> AttemptRecord | None:
    """The job's current attempt as `abandon_attempt` takes it, if it is still `job`'s."""
    row = (
        await session.execute(
            select(*AttemptRecord.columns()).where(Job.id == job.id, Job.attempt == job.attempt)
        )
    ).first()
    return None if row is None else AttemptRecord.from_row(row)


# --- the daemon -------------------------------------------------------------------------


async def run_poller(
    db: Database,
    transport: Transport,
    stop: asyncio.Event,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    unreachable_after: int = DEFAULT_UNREACHABLE_AFTER,
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
    unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT_S,
    ready: asyncio.Event | None = None,
    keep_days: float | None = None,
) -> None:
    """Sweep every `interval` seconds until `stop`; a failed sweep is logged, never fatal.
    `keep_days`: the history retention (default: `RLFLEET_HISTORY_DAYS`, else 7 days)."""
    poller = GpuPoller(
        db,
        transport,
        unreachable_after=unreachable_after,
        command_timeout=command_timeout,
        unreachable_timeout=unreachable_timeout,
        history_days=keep_days if keep_days is not None else history_days(),
    )
    log.info(
        "poller_started",
        interval=interval,
        unreachable_after=unreachable_after,
        poll_timeout=command_timeout,
        unreachable_timeout=unreachable_timeout,
    )
    # A sweep waits for the polls at most until the next one is due; the rest land later.
    wait_s = max(interval - FLUSH_AFTER_S, interval / 2)

    async def sweep() -> None:
        await poller.sweep(wait_s=wait_s)

    def failed(exc: Exception, failures: int) -> None:
        # The database may be down: try again next interval.
        log.error("poll_sweep_failed", error=f"{type(exc).__name__}: {exc}")

    try:
        await run_loop(
            sweep, stop, interval_s=interval, from_start=True, on_error=failed, ready=ready
        )
    finally:
        await poller.close()


async def run(
    settings: Settings,
    stop: asyncio.Event,
    ready: asyncio.Event,
    *,
    liveness: Liveness | None = None,
    unreachable_after: int = DEFAULT_UNREACHABLE_AFTER,
) -> None:
    """The poller daemon: sweep until `stop`, `ready` set after the first sweep. The
    knobs default to the environment's (`Liveness.from_env`); `rlfleet poller` and
    `rlfleet up` both run this."""
    knobs = liveness or Liveness.from_env()
    db = Database(settings.database_url, pool_size=2)
    transport = make_transport()
    try:
        await run_poller(
            db,
            transport,
            stop,
            interval=knobs.poll_interval_s,
            unreachable_after=unreachable_after,
            command_timeout=knobs.poll_timeout_s,
            unreachable_timeout=knobs.unreachable_timeout_s,
            ready=ready,
        )
    finally:
        await transport.close()
        await db.dispose()
