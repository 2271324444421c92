"""The poller's inventory: what a batch of polls says of the fleet, written in one short
transaction: each VM's status, health and launch error, its GPU rows (by UUID: a GPU
nvidia-smi no longer lists is marked unhealthy, never replaced; docs/invariants.md,
invariant 8), each GPU's own health (`scheduler.gpu_health`) with an event when it changes,
and the history samples. Also the VMs silent for the unreachable timeout.
No transaction is open during SSH (invariant 4): this runs after the polls landed."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from scheduler import gpu_health
from scheduler.db import Database
from scheduler.gpu_poller.liveness import record_progress
from scheduler.gpu_poller.state import GpuRow, Outcome, SweepStats, VMState, judge
from scheduler.gpus import RECOUNT_SQL
from scheduler.history import GpuReading, ProgressRow, record_samples
from scheduler.logging import get_logger
from scheduler.poll import PollResult
from scheduler.states import VMStatus

log = get_logger("gpu_poller")

UNHEALTHY = VMStatus.UNHEALTHY.value
"""`vms.status` of a VM that answers SSH but whose GPUs cannot be trusted (nvidia-smi failed)."""


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
    -- How the VM tracks an attempt's processes (remote.cgroup); kept when cut off.
    process_tracking = COALESCE(t.tracking, vms.process_tracking),
    consecutive_failures = 0, unreachable_since = NULL, last_polled_at = now(),
    last_seen_at = now()
FROM unnest(CAST(:ids AS int[]), CAST(:statuses AS text[]), CAST(:errors AS text[]),
            CAST(:launch_errors AS text[]), CAST(:decides AS boolean[]),
            CAST(:trackings AS text[]))
    AS t(id, status, error, launch_error, decides, tracking)
WHERE vms.id = t.id
"""
)

# What the store agent of a job's current attempt reported (`remote.probe.parse_store_status`,
# already checked), written only when it changed.
_STORE_STATUS_SQL = text(
    """
UPDATE jobs SET store_status = CAST(t.status AS jsonb)
FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS int[]), CAST(:statuses AS text[]))
    AS t(id, attempt, status)
WHERE jobs.id = t.id AND jobs.attempt = t.attempt
  AND jobs.store_status IS DISTINCT FROM CAST(t.status AS jsonb)
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
                  utilization_pct, healthy, foreign_busy, health_reason, health_clear_polls,
                  ecc_uncorrected, health_changed_at, updated_at)
SELECT t.vm_id, t.idx, t.u, t.n, t.total, t.used, t.util, t.reason IS NULL, t.fb, t.reason,
       t.clear, t.ecc, CASE WHEN t.reason IS NULL THEN NULL ELSE now() END, now()
FROM unnest(CAST(:vm_ids AS int[]), CAST(:idxs AS int[]), CAST(:uuids AS text[]),
            CAST(:names AS text[]), CAST(:totals AS int[]), CAST(:useds AS int[]),
            CAST(:utils AS int[]), CAST(:fbs AS boolean[]), CAST(:reasons AS text[]),
            CAST(:clears AS int[]), CAST(:eccs AS bigint[]))
    AS t(vm_id, idx, u, n, total, used, util, fb, reason, clear, ecc)
ON CONFLICT (vm_id, uuid) DO UPDATE SET
    index = excluded.index, name = excluded.name,
    memory_total_mb = excluded.memory_total_mb,
    memory_used_mb = excluded.memory_used_mb, utilization_pct = excluded.utilization_pct,
    healthy = excluded.health_reason IS NULL,
    health_reason = excluded.health_reason,
    health_clear_polls = excluded.health_clear_polls,
    ecc_uncorrected = excluded.ecc_uncorrected,
    health_changed_at = CASE WHEN gpus.health_reason IS DISTINCT FROM excluded.health_reason
                             THEN now() ELSE gpus.health_changed_at END,
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
# A GPU the VM had that nvidia-smi no longer lists: lost (`gpu_health`), its row and job kept.
_GPU_ABSENT_SQL = text(
    """
UPDATE gpus SET healthy = false, health_reason = t.reason, health_clear_polls = 0,
    health_changed_at = CASE WHEN gpus.health_reason IS DISTINCT FROM t.reason
                             THEN now() ELSE gpus.health_changed_at END,
    updated_at = now()
FROM unnest(CAST(:vm_ids AS int[]), CAST(:uuids AS text[]), CAST(:reasons AS text[]))
    AS t(vm_id, u, reason)
WHERE gpus.vm_id = t.vm_id AND gpus.uuid = t.u
"""
)
_GPU_EVENTS_SQL = text(
    """
INSERT INTO gpu_events (vm_id, gpu_uuid, gpu_index, kind, reason, actor)
SELECT t.vm_id, t.u, t.idx, t.kind, t.reason, 'poller'
FROM unnest(CAST(:vm_ids AS int[]), CAST(:uuids AS text[]), CAST(:idxs AS int[]),
            CAST(:kinds AS text[]), CAST(:reasons AS text[]))
    AS t(vm_id, u, idx, kind, reason)
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


@dataclass
class _Writes:
    """What a batch of polls writes: rows for one array statement per kind of write."""

    ok: list[dict[str, Any]] = field(default_factory=list)
    """VMs that answered: their status, error line and launch error."""
    failed: list[dict[str, Any]] = field(default_factory=list)
    """VMs whose poll failed, with the error."""
    upserts: list[dict[str, Any]] = field(default_factory=list)
    """GPU rows whose reported values changed."""
    lost_gpus: list[dict[str, Any]] = field(default_factory=list)
    """GPUs of VMs whose nvidia-smi cannot be trusted."""
    absent: list[dict[str, Any]] = field(default_factory=list)
    """GPUs no longer listed, with their health reason."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Changes of a GPU's health (`gpu_events`)."""
    samples: list[GpuReading] = field(default_factory=list)
    progress: list[ProgressRow] = field(default_factory=list)
    store: list[dict[str, Any]] = field(default_factory=list)
    """Store status files read of the attempts this VM runs."""


class SampleGate(Protocol):
    """Which history samples a batch writes (`sweep.HistoryGate`): the others change
    nothing (a step already recorded) or are not due yet (GPU samples)."""

    def keep(
        self, progress: list[ProgressRow], samples: list[GpuReading]
    ) -> tuple[list[ProgressRow], list[GpuReading]]: ...

    def written(self, progress: list[ProgressRow], samples: list[GpuReading]) -> None: ...


async def apply(
    db: Database,
    outcomes: Sequence[Outcome],
    stats: SweepStats,
    *,
    unreachable_after: int,
    unreachable_timeout: float,
    gate: SampleGate | None = None,
) -> None:
    """Write what these polls (one per VM) saw, in one short transaction; count them in
    `stats`. A VM is unreachable after `unreachable_after` failed polls in a row or once
    silent for `unreachable_timeout` seconds. `gate`: which history samples to write
    (None: all)."""
    writes = _Writes()
    ids = [o.vm.target.id for o in outcomes]
    if gate is not None:
        writes.progress, writes.samples = gate.keep(writes.progress, writes.samples)
    async with db.transaction() as session:
        # The GPU rows as they are now, not as the sweep that sent the poll loaded them: a
        # poll can land sweeps later, and a GPU's health is a step from its last state.
        await _reload_gpus(session, [o.vm for o in outcomes if o.result is not None])
        for outcome in outcomes:
            if outcome.result is None:
                writes.failed.append({"vm_id": outcome.vm.target.id, "error": outcome.error})
                _log_failure(outcome.vm, outcome.error or "", unreachable_after)
                continue
            stats.reachable += 1
            _collect(outcome, outcome.result, writes, stats)
        stats.failed += len(writes.failed)
        await _write(
            session,
            writes,
            ids,
            unreachable_after=unreachable_after,
            unreachable_timeout=unreachable_timeout,
        )
    if gate is not None:
        gate.written(writes.progress, writes.samples)


_GPU_ROWS_SQL = text(
    """
SELECT vm_id, uuid, job_id, index, name, memory_total_mb, memory_used_mb, utilization_pct,
       healthy, foreign_busy, health_reason, health_clear_polls, ecc_uncorrected
FROM gpus WHERE vm_id = ANY(:ids)
"""
)


async def _reload_gpus(session: AsyncSession, vms: Sequence[VMState]) -> None:
    """Replace the loaded GPU rows of `vms` with the rows as they are now (caller's
    transaction; only the poller writes a GPU's health, one batch at a time)."""
    if not vms:
        return
    by_id = {vm.target.id: vm for vm in vms}
    for vm in vms:
        vm.gpus = {}
    rows = await session.execute(_GPU_ROWS_SQL, {"ids": list(by_id)})
    for vm_id, uuid, job_id, *values, reason, clear_polls, ecc in rows:
        health = gpu_health.Health(reason, clear_polls, ecc)
        by_id[vm_id].gpus[uuid] = GpuRow(uuid, job_id, tuple(values), health)


def _collect(outcome: Outcome, result: PollResult, writes: _Writes, stats: SweepStats) -> None:
    """Add what the poll of one VM that answered says to `writes`."""
    vm = outcome.vm
    writes.progress += _progress_rows(outcome.vm, result)
    writes.store += _store_rows(outcome.vm, result)
    launch_error, launch_line = _launch_error(outcome)
    decides = _decides_launch_error(outcome)
    if result.error is not None:
        stats.unhealthy += 1
        writes.ok.append(
            {
                "vm_id": vm.target.id,
                "status": UNHEALTHY,
                "error": result.error,
                "launch_error": launch_error,
                "decides": decides,
                "tracking": result.tracking,
            }
        )
        writes.lost_gpus += [{"vm_id": vm.target.id, "uuid": u} for u in vm.gpus]
        if vm.status != UNHEALTHY:
            log.warning("vm_unhealthy", vm=vm.target.name, error=result.error)
        return
    # GPUs fine, but a VM whose python or entrypoint cannot run gets no jobs.
    status = VMStatus.HEALTHY.value if launch_error is None else UNHEALTHY
    writes.ok.append(
        {
            "vm_id": vm.target.id,
            "status": status,
            "error": launch_line,
            "launch_error": launch_error,
            "decides": decides,
            "tracking": result.tracking,
        }
    )
    if launch_error is not None:
        stats.unhealthy += 1
    elif vm.status != VMStatus.HEALTHY:
        log.info("vm_healthy", vm=vm.target.name, was=vm.status)
    # Each GPU's health is judged once per poll, here; `gpu_faults` reads the verdicts.
    outcome.health = judged = judge(vm, result)
    writes.upserts += _gpu_changes(vm, result, judged, outcome.finished, writes.events)
    writes.samples += [
        GpuReading(vm.target.id, g.uuid, g.utilization_pct, g.memory_used_mb, g.memory_total_mb)
        for g in result.gpus
    ]
    seen = {g.uuid for g in result.gpus}
    for uuid, row in vm.gpus.items():
        if uuid in seen:
            continue
        lost = judged[uuid]
        if lost.event is not None:
            log.warning("gpu_unhealthy", vm=vm.target.name, uuid=uuid, reason=lost.event)
            writes.events.append(_event(vm, uuid, row.values[0], lost))
        if lost.health != row.health or row.values[5]:
            writes.absent.append(
                {"vm_id": vm.target.id, "uuid": uuid, "reason": lost.health.reason}
            )


async def _write(
    session: AsyncSession,
    writes: _Writes,
    ids: list[int],
    *,
    unreachable_after: int,
    unreachable_timeout: float,
) -> None:
    """Run the batch's statements (caller's transaction), one per kind of write."""
    if writes.ok:
        await session.execute(
            _VM_OK_SQL,
            _columns(
                writes.ok,
                ids="vm_id",
                statuses="status",
                errors="error",
                launch_errors="launch_error",
                decides="decides",
                trackings="tracking",
            ),
        )
    if writes.failed:
        await session.execute(
            _VM_FAIL_SQL,
            {
                **_columns(writes.failed, ids="vm_id", errors="error"),
                "after": unreachable_after,
                "silent": unreachable_timeout,
            },
        )
        await session.execute(
            _GPUS_OF_UNREACHABLE_SQL, {"ids": [f["vm_id"] for f in writes.failed]}
        )
    if writes.upserts:
        await session.execute(
            _GPU_UPSERT_SQL,
            _columns(
                writes.upserts,
                vm_ids="vm_id",
                idxs="index",
                uuids="uuid",
                names="name",
                totals="total",
                useds="used",
                utils="util",
                fbs="foreign",
                reasons="reason",
                clears="clear",
                eccs="ecc",
            ),
        )
    if writes.lost_gpus:
        await session.execute(
            _GPU_UNHEALTHY_SQL, _columns(writes.lost_gpus, vm_ids="vm_id", uuids="uuid")
        )
    if writes.absent:
        await session.execute(
            _GPU_ABSENT_SQL,
            _columns(writes.absent, vm_ids="vm_id", uuids="uuid", reasons="reason"),
        )
    if writes.events:
        await session.execute(
            _GPU_EVENTS_SQL,
            _columns(
                writes.events,
                vm_ids="vm_id",
                uuids="uuid",
                idxs="index",
                kinds="kind",
                reasons="reason",
            ),
        )
    if ids:
        await session.execute(RECOUNT_SQL, {"ids": ids})
    if writes.store:
        await session.execute(
            _STORE_STATUS_SQL,
            _columns(writes.store, ids="id", attempts="attempt", statuses="status"),
        )
    # After the upserts: a GPU seen for the first time has its row by now.
    await record_samples(session, writes.progress, writes.samples)
    await record_progress(session, writes.progress)


async def mark_silent(
    db: Database, vm_ids: list[int], names: dict[int, str], unreachable_timeout: float
) -> None:
    """VMs whose poll is still out: unreachable once they have been silent long enough
    (the poll itself fails only at its timeout, or never on a frozen connection)."""
    error = f"no answer for over {unreachable_timeout:g}s (poll still waiting)"
    async with db.transaction() as session:
        marked = (
            (
                await session.execute(
                    _VM_SILENT_SQL,
                    {"ids": vm_ids, "silent": unreachable_timeout, "error": error},
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


def _log_failure(vm: VMState, error: str, unreachable_after: int) -> None:
    failures = vm.consecutive_failures + 1
    if failures >= unreachable_after and vm.status != VMStatus.UNREACHABLE:
        log.warning("vm_unreachable", vm=vm.target.name, failures=failures, error=error)
    else:
        log.info("vm_poll_failed", vm=vm.target.name, failures=failures, error=error)


def _columns(rows: Sequence[dict[str, Any]], **names: str) -> dict[str, list[Any]]:
    """Rows as columns: `names` maps each bind parameter to the row key it collects."""
    return {param: [row[key] for row in rows] for param, key in names.items()}


def _progress_rows(vm: VMState, result: PollResult) -> list[ProgressRow]:
    """The progress the poll read of the attempts this VM runs (a line for any other
    attempt is not this sweep's to record)."""
    wanted = {(j.id, j.attempt_number) for j in vm.jobs}
    return [
        ProgressRow(key[0], key[1], state.progress.step, state.progress.reward, state.progress.loss)
        for key, state in result.jobs.items()
        if key in wanted and state.progress is not None
    ]


def _store_rows(vm: VMState, result: PollResult) -> list[dict[str, Any]]:
    """The store status the poll read of the attempts this VM runs."""
    wanted = {(j.id, j.attempt_number) for j in vm.jobs}
    return [
        {"id": key[0], "attempt": key[1], "status": json.dumps(state.store, sort_keys=True)}
        for key, state in result.jobs.items()
        if key in wanted and state.store is not None
    ]


def _event(vm: VMState, uuid: str, index: int | None, step: gpu_health.Step) -> dict[str, Any]:
    """A `gpu_events` row for a GPU whose health changed in this poll."""
    return {
        "vm_id": vm.target.id,
        "uuid": uuid,
        "index": index,
        "kind": "healthy" if step.health.healthy else "unhealthy",
        "reason": (step.event or "")[:500],
    }


def _gpu_changes(
    vm: VMState,
    result: PollResult,
    judged: Mapping[str, gpu_health.Step],
    finished: Collection[int] = (),
    events: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Upsert parameters for the GPUs whose reported values or health differ from their
    rows; the changes of health are added to `events`.

    `finished`: jobs this sweep found ended (and freed). Their attempts had ended before
    nvidia-smi ran, so a process still on their GPUs is foreign."""
    busy = result.busy_uuids()
    rows = []
    for gpu in result.gpus:
        loaded = vm.gpus.get(gpu.uuid)
        health = judged[gpu.uuid]
        if health.event is not None and events is not None:
            if health.health.healthy:
                log.info("gpu_healthy", vm=vm.target.name, uuid=gpu.uuid, reason=health.event)
            else:
                log.warning("gpu_unhealthy", vm=vm.target.name, uuid=gpu.uuid, reason=health.event)
            events.append(_event(vm, gpu.uuid, gpu.index, health))
        # Processes on a GPU allocated to a live job are that job's.
        owned = loaded is not None and loaded.job_id is not None and loaded.job_id not in finished
        foreign = gpu.uuid in busy and not owned
        values = (
            gpu.index,
            gpu.name,
            gpu.memory_total_mb,
            gpu.memory_used_mb,
            gpu.utilization_pct,
            health.health.healthy,
            foreign,
        )
        if loaded is not None and loaded.values == values and loaded.health == health.health:
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
                "reason": health.health.reason,
                "clear": health.health.clear_polls,
                "ecc": health.health.ecc_baseline,
            }
        )
    return rows
