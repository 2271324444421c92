"""`job logs`: an attempt's train.log (or a group role's log) read on the VM that ran it,
byte for byte, once or following it while the job is live (`stream_log`), and a piece at
a time for the dashboard (`read_log_chunk`). Each read is load (short transaction) → SSH
(no transaction), like the rest of `scheduler.control`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from scheduler.control import JobPlace, load_place, load_rank_place, read_attempt_file
from scheduler.db import Database
from scheduler.errors import BadInput, ServiceUnavailable
from scheduler.models import Job
from scheduler.remote.layout import Attempt
from scheduler.remote.logs import READ_CHUNK_BYTES, parse_tokens, role_log, tokens_script
from scheduler.states import LIVE_STATES
from scheduler.transport import Transport, TransportError


def _pick_attempt(place: JobPlace, attempt: int | None) -> int:
    if place.newest_attempt == 0:
        raise BadInput(f"job {place.job_id} has not started yet ({place.status}): no log")
    if attempt is None:
        # The attempt the row names: the one that completed the job, else the newest.
        return place.attempt.attempt if place.attempt is not None else place.newest_attempt
    if not 1 <= attempt <= place.newest_attempt:
        raise BadInput(
            f"job {place.job_id} has attempts 1 to {place.newest_attempt};"
            f" there is no attempt {attempt}"
        )
    return attempt


async def _locate(transport: Transport, place: JobPlace, attempt: int) -> Attempt:
    """The directory of attempt `attempt`: the row's for its own attempt; an earlier one's
    is looked up on the VM among this installation's directories of that attempt."""
    assert place.target is not None
    if place.attempt is not None and place.attempt.attempt == attempt:
        return place.attempt
    try:
        result = await transport.run(
            place.target, tokens_script(place.installation, place.job_id, attempt), timeout=30
        )
    except TransportError as exc:
        raise ServiceUnavailable(f"cannot list attempts of job {place.job_id}: {exc}") from exc
    tokens = parse_tokens(result.stdout)
    if len(tokens) != 1:
        why = "no directory" if not tokens else f"{len(tokens)} directories"
        raise BadInput(
            f"job {place.job_id}: {why} of attempt {attempt} on {place.target.name}"
            " (an attempt's log stays on the VM that ran it)"
        )
    return Attempt(place.installation, place.job_id, attempt, tokens[0])


async def _read_all(
    transport: Transport,
    place: JobPlace,
    run: Attempt,
    offset: int,
    write: Callable[[bytes], Any],
    name: str = "train.log",
) -> tuple[int, bool]:
    """Write the log `name` from `offset` to its current end; the new offset, and whether
    the file exists."""
    while True:
        chunk = await read_attempt_file(transport, place, run, name, offset, timeout=30)
        if chunk is None:
            return offset, False
        if chunk:
            write(chunk)
            offset += len(chunk)
        if len(chunk) < READ_CHUNK_BYTES:
            return offset, True


async def stream_log(
    db: Database,
    transport: Transport,
    job_id: int,
    write: Callable[[bytes], Any],
    *,
    attempt: int | None = None,
    follow: bool = False,
    poll_s: float = 1.0,
    node: int = 0,
    role: str | None = None,
) -> None:
    """Write the attempt's `train.log` (default: the current attempt) with `write`, byte
    for byte as the job wrote it (offsets count bytes; invalid UTF-8 is passed on as is).
    `node` picks the rank of a multi-node job: its log is read on its own VM.

    With `follow`, keep writing what is appended until the job is no longer live, like
    `tail -f` that knows when to stop.
    """
    name, role_node = await _log_name(db, job_id, role, node)
    node = role_node if role_node is not None else node
    place = await load_rank_place(db, job_id, node)
    wanted = _pick_attempt(place, attempt)
    if place.target is None:
        raise BadInput(f"job {job_id} has no VM recorded; no log to read")
    if node > 0 and wanted != place.newest_attempt:
        # Only the current attempt's ranks are recorded; an earlier one's VMs are not.
        raise BadInput(
            f"job {job_id}: only the current attempt ({place.newest_attempt}) of rank {node} is "
            "known; earlier attempts can be read for rank 0 only"
        )
    run = await _locate(transport, place, wanted)
    offset = 0
    while True:
        offset, exists = await _read_all(transport, place, run, offset, write, name)
        if not follow:
            return
        if not exists and offset == 0 and place.status not in LIVE_STATES:
            return
        now = await load_rank_place(db, job_id, node)
        if now.status not in LIVE_STATES or now.newest_attempt != wanted:
            # One last read: what the process wrote just before it ended.
            await _read_all(transport, place, run, offset, write, name)
            return
        if run.path is None and now.attempt is not None and now.attempt.token == run.token:
            run = now.attempt  # the launch has recorded its directory meanwhile
        await asyncio.sleep(poll_s)


async def _log_name(
    db: Database, job_id: int, role: str | None, rank: int = 0
) -> tuple[str, int | None]:
    """The attempt file `job logs` reads: train.log (the supervisor's, for a job group),
    or `<role>.log` of one role of a job group (`BadInput` when the job has no such role,
    or the role no such rank), with the node whose VM runs that rank of the role when the
    group spans several VMs."""
    if role is None:
        return "train.log", None
    from scheduler.attempts.shape import JobShape

    async with db.transaction() as session:
        row = (
            await session.execute(
                select(Job.nodes, Job.gpus_requested, Job.roles).where(Job.id == job_id)
            )
        ).first()
    shape = JobShape.of_row(row) if row is not None else JobShape.training(1)
    # A row whose roles do not read back has no roles.
    names = list(shape.role_names) if shape.spec is not None else []
    if role not in names:
        known = ", ".join(names) if names else "none: it is not a job group"
        raise BadInput(f"job {job_id} has no role {role} (roles: {known})")
    nodes = shape.ranks_of(role)
    if not 0 <= rank < len(nodes):
        raise BadInput(
            f"job {job_id}: role {role} runs on {len(nodes)} node(s); --node 0..{len(nodes) - 1}"
        )
    return role_log(role), nodes[rank] if shape.multi_node else None


@dataclass(frozen=True)
class LogChunk:
    """A piece of an attempt's train.log, for a page that follows it."""

    attempt: int
    offset: int
    """Where the next read starts (bytes)."""
    data: bytes
    exists: bool
    """Whether train.log exists (yet)."""
    live: bool
    """Whether the job is still starting or running, so that more may come."""


async def read_log_chunk(
    db: Database, transport: Transport, job_id: int, *, offset: int = 0, attempt: int | None = None
) -> LogChunk:
    """The attempt's train.log from byte `offset`, at most `READ_CHUNK_BYTES` (default:
    the attempt `job logs` shows). `BadInput` when the job has no log."""
    place = await load_place(db, job_id)
    wanted = _pick_attempt(place, attempt)
    if place.target is None:
        raise BadInput(f"job {job_id} has no VM recorded; no log to read")
    run = await _locate(transport, place, wanted)
    data = await read_attempt_file(transport, place, run, "train.log", offset, timeout=30)
    live = place.status in LIVE_STATES and place.newest_attempt == wanted
    if data is None:
        return LogChunk(wanted, offset, b"", False, live)
    return LogChunk(wanted, offset + len(data), data, True, live)


@dataclass(frozen=True)
class Diagnostics:
    """What was captured of one attempt before it was stopped as hung or stuck starting
    (`models.JobDiagnostics`; the same text is `diagnostics.txt` in its directory)."""

    attempt: int
    vm_name: str | None
    reason: str
    captured_at: Any
    content: str

    def header(self) -> str:
        """`attempt 1 on vm0, 2026-11-25 17:50:34+00:00: hung: step 3 …`"""
        where = f" on {self.vm_name}" if self.vm_name else ""
        return f"attempt {self.attempt}{where}, captured {self.captured_at}: {self.reason}"


async def read_diagnostics(db: Database, job_id: int, attempt: int | None = None) -> Diagnostics:
    """The diagnostics of attempt `attempt` (default: the newest attempt that has some),
    read from the database (no SSH: they are there whether or not the VM answers).
    `BadInput` when there are none."""
    from scheduler.models import JobDiagnostics

    query = select(JobDiagnostics).where(JobDiagnostics.job_id == job_id)
    if attempt is not None:
        query = query.where(JobDiagnostics.attempt == attempt)
    async with db.transaction() as session:
        exists = await session.scalar(select(Job.id).where(Job.id == job_id))
        row = await session.scalar(query.order_by(JobDiagnostics.attempt.desc()).limit(1))
        if exists is None:
            raise BadInput(f"no job {job_id}")
        if row is None:
            which = f"attempt {attempt} of job {job_id} has" if attempt else f"job {job_id} has"
            raise BadInput(
                f"{which} no diagnostics: they are captured when an attempt is stopped as "
                "hung or stuck starting (--hang-timeout, --startup-timeout)"
            )
        return Diagnostics(row.attempt, row.vm_name, row.reason, row.captured_at, row.content)
