"""The poller's sweep: every VM probed at once, one SSH round trip each, the results
recorded in batches as they land.

A sweep is load → probe → record (docs/invariants.md, invariant 4: no transaction is open
during SSH): one short transaction loads every VM, its GPU rows and the ranks of the live
attempts on it (`load_vms`, `finish.load_ranks`); every VM runs `poll.poll_command`
concurrently; as results land, in batches, the ended attempts are finished
(`finish.finish_jobs`) and then what the polls saw is written (`inventory.apply`). A poll
still out when the sweep's time is up is left running and recorded when it lands; a VM
silent for `--unreachable-timeout` seconds is marked unreachable meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence

from sqlalchemy import Integer, any_, bindparam, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import metrics
from scheduler.db import Database, installation_id
from scheduler.gpu_health import Health
from scheduler.gpu_poller.finish import finish_jobs, load_ranks
from scheduler.gpu_poller.gpu_faults import stop_on_broken_gpus
from scheduler.gpu_poller.inventory import apply, mark_silent
from scheduler.gpu_poller.liveness import load_watches, stalls, stop_stalled
from scheduler.gpu_poller.restarts import record_restarts
from scheduler.gpu_poller.shares import Shares
from scheduler.gpu_poller.state import GpuRow, Outcome, SweepStats, VMState
from scheduler.hang import Stall, Watch
from scheduler.history import PRUNE_EVERY_S, GpuReading, ProgressRow, prune
from scheduler.liveness import UNREACHABLE_AFTER_POLLS, Liveness
from scheduler.logging import get_logger
from scheduler.models import GPU, VM
from scheduler.poll import PollResult, cut_poll, parse_poll, poll_command, poll_output_limit
from scheduler.remote.jobuser import ready_check
from scheduler.remote.launch import entry_check_words
from scheduler.store_records import record_reports
from scheduler.transport import Transport, TransportError, VMTarget
from scheduler.verdicts import LiveJob

log = get_logger("gpu_poller")

DEFAULT_INTERVAL_S = Liveness.poll_interval_s
DEFAULT_UNREACHABLE_AFTER = UNREACHABLE_AFTER_POLLS
DEFAULT_COMMAND_TIMEOUT_S = Liveness.poll_timeout_s
DEFAULT_UNREACHABLE_TIMEOUT_S = Liveness.unreachable_timeout_s
FLUSH_AFTER_S = 0.2
"""Results that came in are written at the latest this long after the first of them, so
the VMs that answer are recorded at once, whatever a silent one does."""
SILENT_CHECK_S = 1.0
"""While polls are out, how often the sweep checks whether their VMs have been silent for
the unreachable timeout (a poll on a frozen connection may not fail for a while)."""


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
        shares: Shares | None = None,
        gpu_sample_every_s: float = 0.0,
    ) -> None:
        self.db = db
        self.history = HistoryGate(gpu_sample_every_s)
        """Which history samples a batch writes: no step twice, GPU samples of a VM at most
        every `gpu_sample_every_s` (0: every poll)."""
        self.shares = shares
        """With shares, only the VMs this poller holds are polled and recorded (several
        pollers divide the fleet); None: every VM (a poller alone, or a test)."""
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
        self._targets: dict[int, VMTarget] = {}
        """Each VM this poller loaded, by id: its connection is closed once the VM is no
        longer this poller's."""
        self._job_users: dict[int, str | None] = {}
        """Each VM's job user as last seen to work (None: none needs checking)."""
        self._failing: set[int] = set()
        """VMs whose latest poll failed."""
        self._landed: asyncio.Queue[Outcome] = asyncio.Queue()
        self._restarts: dict[tuple[int, int, int], dict[str, int]] = {}
        """The restarts in place recorded per (job, attempt, rank) (`restarts`)."""
        self._watches: dict[tuple[int, int], Watch] = {}
        """Running attempts' liveness (`gpu_poller.liveness`), as the last load read it."""
        self._stopping: dict[int, asyncio.Task[bool]] = {}
        """Stalled attempts being captured and stopped, by job id."""

    @property
    def in_flight(self) -> list[int]:
        """Ids of the VMs whose poll is still out."""
        return list(self._inflight)

    async def sweep(
        self, *, wait_s: float | None = None, only: Collection[int] | None = None
    ) -> SweepStats:
        """Poll every VM once (every VM this poller holds, with shares) and record what
        was seen.

        `wait_s`: wait at most this long for the polls (the daemon passes its interval);
        polls still out then are left running. None waits until every poll has landed.
        `only`: poll just these VMs (those a renewal just took)."""
        started = time.monotonic()
        cpu_started = time.process_time()
        vms = await self._load(only)
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
        if deadline is None and self._stopping:
            # Not the daemon's timed sweep: wait for the stalled attempts to be stopped.
            await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        await self.prune_history()
        stats.seconds = time.monotonic() - started
        stats.cpu_seconds = time.process_time() - cpu_started
        metrics.observe_poll_sweep(stats.seconds)
        if only is None:
            metrics.observe_poller_sweep(stats.seconds, stats.cpu_seconds)
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
        """Cancel the polls still out (the daemon is stopping) and the stops of stalled
        attempts (a job already failed is killed by the requeue manager's leftover sweep)."""
        tasks = [*self._inflight.values(), *self._stopping.values()]
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
        """`inventory.mark_silent` with this poller's unreachable timeout."""
        if self.shares is not None:
            vm_ids = [i for i in vm_ids if self.shares.holds(i)]
            if not vm_ids:
                return
        await mark_silent(self.db, vm_ids, names, self.unreachable_timeout)

    async def _record(self, outcomes: Sequence[Outcome], stats: SweepStats) -> None:
        outcomes = latest_per_vm(outcomes)
        if self.shares is not None:
            # A VM released or lost meanwhile is another poller's now: its poll, sent while
            # this one held it, is not recorded over theirs.
            outcomes = [o for o in outcomes if self.shares.holds(o.vm.target.id)]
            if not outcomes:
                return
        stats.polled += len(outcomes)
        for outcome in outcomes:
            if outcome.result is None:
                self._failing.add(outcome.vm.target.id)
            else:
                self._failing.discard(outcome.vm.target.id)
        # Before the attempts that ended are finished: their last restarts go first, and
        # what their store agents reported writing.
        await record_restarts(self.db, outcomes, self._restarts)
        await record_reports(self.db, outcomes)
        stats.jobs_finished += await finish_jobs(self.db, outcomes)
        for outcome, job, verdict in stalls(outcomes, self._watches):
            self._stop(outcome, job, verdict)
        await self._apply(outcomes, stats)
        # After the GPU rows say so: a stopped job's GPUs are then not offered again.
        stats.jobs_finished += await stop_on_broken_gpus(self.db, outcomes)

    def _stop(self, outcome: Outcome, job: LiveJob, verdict: Stall) -> None:
        """Capture and stop a stalled attempt in a task of its own (SSH, then a short
        transaction, then the kill): the sweep goes on meanwhile. Once per job at a time."""
        if job.id in self._stopping:
            return
        task = asyncio.create_task(
            stop_stalled(self.db, self.transport, outcome.vm.target, job, verdict)
        )
        self._stopping[job.id] = task

        def done(finished: asyncio.Task[bool]) -> None:
            if self._stopping.get(job.id) is finished:
                del self._stopping[job.id]
            if not finished.cancelled() and finished.exception() is not None:
                log.error("stop_stalled_failed", job_id=job.id, error=repr(finished.exception()))

        task.add_done_callback(done)

    async def _load(self, only: Collection[int] | None = None) -> list[VMState]:
        ids: Collection[int] | None = only
        if self.shares is not None:
            mine = self.shares.mine()
            ids = mine if only is None else mine & set(only)
            metrics.set_poller_held(len(mine))
            if only is None:
                # A VM no longer held is no longer this poller's to find failing, nor
                # worth a connection kept open (with its keepalives).
                self._failing.intersection_update(mine)
                self._forget(set(self._targets) - mine)
        if ids is not None and not ids:
            return []
        async with self.db.transaction() as session:
            # Plain columns, not ORM objects: this runs for every VM on every sweep.
            vms = await load_vms(session, ids)
            self._targets.update((vm_id, vm.target) for vm_id, vm in vms.items())
            installation = await installation_id(session)
            self._watches = await load_watches(session)
            for job in await load_ranks(session, installation):
                if job.vm_id in vms:
                    vms[job.vm_id].jobs.append(job)
        return list(vms.values())

    def _forget(self, vm_ids: set[int]) -> None:
        """Close the connections to VMs this poller no longer holds."""
        forget = getattr(self.transport, "forget", None)
        for vm_id in vm_ids:
            target = self._targets.pop(vm_id)
            if forget is not None:
                forget(target)

    async def _probe(self, vm: VMState) -> Outcome:
        check = None
        if vm.launch_error is not None:
            # Until its python and entrypoint work again, every poll checks them.
            check = " ".join(entry_check_words(vm.target.python, vm.target.entrypoint))
            check = ready_check(vm.target, check)
        elif self._job_users.get(vm.target.id) != vm.target.job_user:
            # A job user not yet seen to work (`sudo -n -u J`): checked once.
            check = ready_check(vm.target, "true")
        attempts = [j.attempt for j in vm.jobs if j.attempt is not None]
        command = poll_command(attempts, check)
        limit = poll_output_limit(len(attempts))
        try:
            # persistent: a poll every few seconds is worth a shell kept open on the VM.
            result = await self.transport.run(
                vm.target, command, timeout=self.command_timeout, persistent=True,
                max_output=limit,
            )  # fmt: skip
            if result.stdout_dropped:
                return Outcome(vm, result=cut_poll(limit, result.stdout_dropped))
            return self._job_user_outcome(vm, parse_poll(result.stdout))
        except TransportError as exc:
            return Outcome(vm, error=str(exc))
        except Exception as exc:  # a bug or an odd answer must not stop the sweep
            log.exception("poll_probe_crashed", vm=vm.target.name)
            return Outcome(vm, error=f"poll failed: {type(exc).__name__}: {exc}")

    def _job_user_outcome(self, vm: VMState, result: PollResult) -> Outcome:
        """The outcome of a poll that (for a VM not marked) checked its job user alone:
        when sudo to it fails, the VM cannot start training (`launch_error`, shown by
        `vm show`, until the check passes); when it works, it is not asked again."""
        if vm.launch_error is not None or result.check is None:
            return Outcome(vm, result=result)
        rc, line = result.check
        if rc == 0:
            self._job_users[vm.target.id] = vm.target.job_user
            return Outcome(vm, result=result)
        return Outcome(vm, result=result, launch_error=f"job user: {line}"[:500])

    async def _apply(self, outcomes: Sequence[Outcome], stats: SweepStats) -> None:
        """Write what these polls saw (`inventory.apply`), with this poller's thresholds."""
        await apply(
            self.db,
            outcomes,
            stats,
            unreachable_after=self.unreachable_after,
            unreachable_timeout=self.unreachable_timeout,
            gate=self.history,
        )


class HistoryGate:
    """Which history samples a poller writes (`inventory.SampleGate`): a progress step
    only when it is not the step last written for that attempt (the row would change
    nothing), and a VM's GPU samples at most every `gpu_every_s` seconds (0: every poll).
    What was written is noted only once its transaction committed."""

    def __init__(self, gpu_every_s: float = 0.0) -> None:
        self.gpu_every_s = gpu_every_s
        self._sampled_at: dict[int, float] = {}
        self._steps: dict[tuple[int, int], int] = {}

    def keep(
        self, progress: list[ProgressRow], samples: list[GpuReading]
    ) -> tuple[list[ProgressRow], list[GpuReading]]:
        """The rows of a batch worth writing."""
        progress = [p for p in progress if self._steps.get((p.job_id, p.attempt)) != p.step]
        if self.gpu_every_s > 0:
            now = time.monotonic()
            due = self._sampled_at
            samples = [s for s in samples if now - due.get(s.vm_id, -1e18) >= self.gpu_every_s]
        return progress, samples

    def written(self, progress: list[ProgressRow], samples: list[GpuReading]) -> None:
        """Note what a committed batch wrote."""
        for p in progress:
            self._steps[(p.job_id, p.attempt)] = p.step
        if len(self._steps) > 100_000:  # attempts long over: forget them
            self._steps.clear()
        if self.gpu_every_s > 0:
            now = time.monotonic()
            for s in samples:
                self._sampled_at[s.vm_id] = now


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


async def load_vms(session: AsyncSession, ids: Collection[int] | None = None) -> dict[int, VMState]:
    """Every VM (or those of `ids`) with its GPU rows, by id."""
    query = select(*VMTarget.columns(), VM.status, VM.consecutive_failures, VM.launch_error)
    gpu_filter = []
    if ids is not None:
        # One array parameter, whatever the number of VMs.
        wanted = bindparam("ids", sorted(ids), type_=ARRAY(Integer))
        query = query.where(VM.id == any_(wanted))
        gpu_filter = [GPU.vm_id == any_(wanted)]
    vm_rows = await session.execute(query)
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
            GPU.health_reason,
            GPU.health_clear_polls,
            GPU.ecc_uncorrected,
        ).where(*gpu_filter)
    )
    for vm_id, uuid, job_id, *values, reason, clear_polls, ecc in gpu_rows:
        if vm_id in vms:
            health = Health(reason, clear_polls, ecc)
            vms[vm_id].gpus[uuid] = GpuRow(uuid, job_id, tuple(values), health)
    return vms
