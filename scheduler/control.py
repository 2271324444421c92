"""What a user does to one job after submitting it: cancel, retry, read its progress
(its log: `scheduler.job_logs`).

Each operation follows load (short transaction) → SSH (no transaction) → apply (short
guarded transaction), like the daemons. The CLI is a thin layer over these functions.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select

from scheduler import bus
from scheduler.attempts.end import How, RankEnd, decide
from scheduler.attempts.finish import AttemptRecord, end_attempt
from scheduler.db import Database, installation_id
from scheduler.errors import BadInput, ServiceUnavailable
from scheduler.jobs import get_job, show_job, transition
from scheduler.kill import kill_attempt
from scheduler.leftovers import close_leftover
from scheduler.logging import get_logger
from scheduler.models import Workdir
from scheduler.remote.layout import Attempt, default_output_dir, stored_attempt
from scheduler.remote.logs import (
    NO_FILE_EXIT,
    READ_CHUNK_BYTES,
    read_file_script,
)
from scheduler.remote.output import load_json, printable
from scheduler.remote.restarts import MAX_ROLE_RESTARTS
from scheduler.settings import Settings
from scheduler.states import FINAL_STATES, LIVE_STATES, JobStatus
from scheduler.submit import announce
from scheduler.transport import Transport, TransportError, VMTarget

log = get_logger("control")

DEFAULT_GRACE_S = 10.0
PROGRESS_TIMEOUT_S = 5.0
STATE_FILE_BYTES = 64 * 1024
"""At most this much of progress.json or roles.json is read for `job show` (they are a
few hundred bytes; a bigger one is cut, and then unreadable)."""
SAFE_DEPTH = 16
"""How deep `json_safe` keeps nested values of a job-written JSON file."""


@dataclass(frozen=True)
class JobPlace:
    """Where a job's current attempt is (or was): read in a short transaction."""

    job_id: int
    status: str
    newest_attempt: int
    """The job row's `attempt`: its newest attempt's number (0 before the first claim)."""
    target: VMTarget | None
    gpu_indices: list[int] | None
    attempt: Attempt | None = None
    """The attempt the row names (its directory): the newest, or the one that completed
    the job; None before the first claim."""
    remote_pid: int | None = None
    """The pid recorded when the launch was confirmed; None: not confirmed."""
    installation: str = ""
    gpu_uuids: list[str] | None = None
    rank: int = 0
    """Which rank (VM) of the attempt this is."""


async def load_place(db: Database, job_id: int) -> JobPlace:
    """The job's state and VM, detached from the session (`NotFound` if no such job)."""
    async with db.transaction() as session:
        job = await get_job(session, job_id)
        return place_of(job, await installation_id(session))


async def load_rank_place(db: Database, job_id: int, rank: int) -> JobPlace:
    """Where rank `rank` of the attempt the job row names is: its own VM, directory and pid
    (`NotFound` if no such job, `BadInput` if the job has no such rank). `rank_place`."""
    async with db.transaction() as session:
        job = await get_job(session, job_id, with_ranks=True)
        return rank_place(job, await installation_id(session), rank)


async def load_all_places(db: Database, job_id: int) -> list[JobPlace]:
    """Where every rank of the job's current attempt is (`job_nodes`, one per VM, rank 0
    first; one for a single-node job). A job never claimed has no ranks: its one place is
    its row's (no VM)."""
    async with db.transaction() as session:
        job = await get_job(session, job_id, with_ranks=True)
        installation = await installation_id(session)
        place = place_of(job, installation)
        ranks = [_node_place(job, place, installation, n) for n in _current_nodes(job)]
        return ranks or [place]


def _current_nodes(job: Any) -> list[Any]:
    """The loaded `job_nodes` rows of the job's current attempt, rank 0 first."""
    return [node for node in job.ranks if node.attempt == job.attempt]


def rank_place(job: Any, installation: str, rank: int) -> JobPlace:
    """Rank `rank`'s place (job loaded with its `ranks`): its `job_nodes` row, for every
    rank alike, while that row is of the attempt the job row names. The job row, rank 0's
    copy, alone still names an attempt whose rows a newer claim replaced (a job completed
    by an earlier attempt's late success), and a job never claimed has no rows at all."""
    if not 0 <= rank < job.nodes:
        nodes = (
            "1 node (rank 0)" if job.nodes == 1 else f"{job.nodes} nodes (ranks 0-{job.nodes - 1})"
        )
        raise BadInput(f"job {job.id} has {nodes}; there is no rank {rank}")
    place = place_of(job, installation)
    named = job.completed_attempt or job.attempt
    node = next((n for n in job.ranks if n.rank == rank and n.attempt == named), None)
    if node is not None:
        return _node_place(job, place, installation, node)
    if rank > 0:
        raise BadInput(f"job {job.id} has not been placed yet ({job.status}): no rank {rank}")
    return place


def _node_place(job: Any, place: JobPlace, installation: str, node: Any) -> JobPlace:
    """The place of the job's `job_nodes` row `node`, with the job's state from `place`."""
    return replace(
        place,
        target=VMTarget.from_vm(node.vm) if node.vm is not None else None,
        gpu_indices=node.gpu_indices,
        gpu_uuids=node.gpu_uuids,
        attempt=stored_attempt(
            installation, job.id, node.attempt, job.launch_token, node.attempt_dir
        ),
        remote_pid=node.remote_pid,
        rank=node.rank,
    )


def place_of(job: Any, installation: str) -> JobPlace:
    """A loaded job row as a `JobPlace`. A completed job names the attempt that completed
    it (its VM and directory are the row's), which need not be the newest."""
    target = VMTarget.from_vm(job.vm) if job.vm is not None else None
    number = job.completed_attempt or job.attempt
    attempt = stored_attempt(installation, job.id, number, job.launch_token, job.attempt_dir)
    return JobPlace(
        job.id,
        job.status,
        job.attempt,
        target,
        job.gpu_indices,
        attempt,
        job.remote_pid,
        installation,
        job.gpu_uuids,
    )


async def job_details(
    db: Database,
    job_id: int,
    transport: Transport | None = None,
    *,
    events_limit: int | None = None,
    events_before: int | None = None,
) -> dict[str, Any]:
    """A job as `job show --json` prints it: its row, its events (the newest
    `events_limit` of those before event `events_before`, when given: `show_job`), where
    its outputs are, and, with a `transport`, its training progress read from the VM (a
    few seconds at most; `progress_error` says why there is none). `NotFound` if no such
    job."""
    async with db.transaction() as session:
        data = await show_job(
            session, job_id, events_limit=events_limit, events_before=events_before
        )
        job = await get_job(session, job_id, with_ranks=True)
        installation = await installation_id(session)
        place = place_of(job, installation)
        ranks = [_node_place(job, place, installation, n) for n in _current_nodes(job)]
        workdir = None
        if job.workdir_digest is not None:
            workdir = (
                await session.execute(
                    select(Workdir.size, Workdir.files).where(Workdir.digest == job.workdir_digest)
                )
            ).one_or_none()
    data["workdir_size"] = workdir.size if workdir is not None else None
    data["workdir_files"] = workdir.files if workdir is not None else None
    # Where the outputs are on the VM, also when the job named no --output-dir.
    data["output_dir"] = data["output_dir"] or default_output_dir(installation, job_id)
    data["store_status"] = _store_status(job.store_status) if data.get("store") else None
    data["progress"], data["progress_error"] = None, None
    if transport is not None and place.newest_attempt > 0 and place.target is not None:
        data["progress"], data["progress_error"] = await read_progress(transport, place)
        if data.get("roles") and place.attempt is not None and place.attempt.attempt == job.attempt:
            for node in ranks:
                # Each VM's supervisor knows the roles of its own layout node.
                if node.attempt is not None and node.target is not None:
                    seen = await read_role_states(transport, node)
                    merge_role_states(data["roles"], seen, node.rank)
    return data


def _store_status(value: Any) -> dict[str, Any] | None:
    """The row's `store_status`, checked again as the poller checked it (a row may have
    been written by hand)."""
    import json

    from scheduler.remote.probe import parse_store_status

    if not isinstance(value, dict):
        return None
    return parse_store_status(json.dumps(value))


ROLE_STATES = frozenset({"waiting", "running", "restarting", "exited", "stopped"})


async def read_role_states(transport: Transport, place: JobPlace) -> dict[str, Any]:
    """The group supervisor's `roles.json` of the current attempt ({} when unreadable)."""
    assert place.attempt is not None
    try:
        text = await read_attempt_file(
            transport, place, place.attempt, "roles.json", 0, PROGRESS_TIMEOUT_S, STATE_FILE_BYTES
        )
    except ServiceUnavailable:
        return {}
    data = load_json(text) if text else None
    return data if isinstance(data, dict) else {}


def merge_role_states(roles: list[dict[str, Any]], seen: dict[str, Any], node: int = 0) -> None:
    """Put each role's pid, state, exit code and restarts in place, as the supervisor of
    layout node `node` wrote them, into `job show`'s entries of the roles that node runs
    (restarts only when more than the poller recorded); values that are not what the
    supervisor writes are ignored."""
    for role in roles:
        if role.get("node", 0) != node:
            continue
        entry = seen.get(role["name"])
        if not isinstance(entry, dict) or entry.get("state") not in ROLE_STATES:
            continue
        role["state"] = entry["state"]
        for key in ("pid", "exit_code"):
            value = entry.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and -1 < value < 2**31:
                role[key] = value
        restarts = entry.get("restarts")
        if (
            isinstance(restarts, int)
            and not isinstance(restarts, bool)
            and (role.get("restarts", 0) < restarts <= MAX_ROLE_RESTARTS)
        ):
            role["restarts"] = restarts


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_job` did: the state left, and what the kill on the VM said."""

    job_id: int
    previous: str
    kill: str | None = None
    """`terminated`, `killed`, `gone`, `fenced`, `nopid`, `unreachable: …`, or None
    (nothing ran)."""
    dead: bool = False
    """The attempt surely runs no process: its GPUs are free again."""


async def cancel_job(
    db: Database,
    transport: Transport,
    job_id: int,
    *,
    actor: str = "cli",
    grace_s: float = DEFAULT_GRACE_S,
) -> CancelResult:
    """Cancel any job that is not final; a live one has its process group killed on its VM
    (TERM, then KILL after `grace_s`). `BadInput` if final.

    One transaction moves the job to `cancelled` and, for a live attempt, records it as a
    leftover that keeps its GPUs out of every claim until the attempt is known to be dead
    (`attempts.finish.end_attempt`), and frees the job's GPUs. The kill runs after it (no
    transaction open); if it proves the attempt dead, a second transaction closes the row.
    If the kill cannot tell (VM unreachable) or this process dies in between, the requeue
    manager kills the attempt later and closes the row: nothing is left holding GPUs with
    nobody to free them.
    """
    for _ in range(5):
        places = await load_all_places(db, job_id)
        place = places[0]
        status = JobStatus(place.status)
        if status in FINAL_STATES:
            raise BadInput(f"job {job_id} is already {status}; there is nothing to cancel")
        live = status in LIVE_STATES and place.target is not None
        async with db.transaction() as session:
            moved = await end_attempt(
                session,
                AttemptRecord(
                    job_id,
                    # The attempt read above: if the job went on to another one meanwhile,
                    # this move loses and the loop looks again. Its ranks (where each runs)
                    # are read from `job_nodes` by `end_attempt`.
                    place.newest_attempt,
                    None,
                    token=place.attempt.token if place.attempt is not None else None,
                ),
                decide(None, RankEnd(How.CANCELLED, "cancelled by the user", may_run=live)),
                expected=status,
                actor=actor,
            )
        if not moved:
            continue  # it moved under us: look again
        if not live:
            log.info("job_cancelled", job_id=job_id, previous=status.value)
            return CancelResult(job_id, status.value)
        if place.attempt is None:  # a live job always has a token; a row without one has no dir
            return CancelResult(job_id, status.value, "no launch token recorded")
        return await _kill_ranks(db, transport, places, status, grace_s)
    raise ServiceUnavailable(f"job {job_id} kept changing state; try again")


async def _kill_ranks(
    db: Database,
    transport: Transport,
    places: list[JobPlace],
    previous: JobStatus,
    grace_s: float,
) -> CancelResult:
    """Kill every rank of a cancelled attempt at once, each on its own VM (no transaction
    open), then close in one short transaction the leftover of each rank proven dead. A
    rank whose VM row is gone has no leftover to close and is not waited for."""
    ranks = [p for p in places if p.target is not None and p.attempt is not None]
    kills = await asyncio.gather(
        *(
            kill_attempt(
                transport,
                p.target,
                p.attempt,
                grace_s=grace_s,
                # A recorded pid: the rank started, so it is never "stopped before it started".
                launched=p.remote_pid is not None,
            )
            for p in ranks
            if p.target is not None and p.attempt is not None
        )
    )
    dead = [(p, k) for p, k in zip(ranks, kills, strict=True) if k.dead]
    if dead:
        async with db.transaction() as session:
            for p, _kill in dead:
                assert p.target is not None
                await close_leftover(
                    session, vm_id=p.target.id, job_id=p.job_id, attempt=p.newest_attempt
                )
    words = [k.describe() for k in kills]
    first = places[0]
    described = (
        words[0]
        if len(set(words)) == 1
        else "; ".join(
            f"{p.target.name if p.target else '?'}: {w}" for p, w in zip(ranks, words, strict=True)
        )
    )
    log.info(
        "job_cancelled",
        job_id=first.job_id,
        vms=[p.target.name for p in ranks if p.target is not None],
        attempt=first.newest_attempt,
        previous=previous.value,
        kill=described,
        gpus_blocked=len(dead) < len(ranks),
    )
    return CancelResult(first.job_id, previous.value, described, len(dead) == len(ranks))


async def retry_job(db: Database, settings: Settings, job_id: int, *, actor: str = "cli") -> bool:
    """Move a `failed` job back to `queued` and publish it; `BadInput` for any other state.

    Returns whether the publish reached NATS (if not, the requeue manager publishes it).
    """
    place = await load_place(db, job_id)
    if place.status != JobStatus.FAILED:
        raise BadInput(f"job {job_id} is {place.status}; only a failed job can be retried")
    async with db.transaction() as session:
        moved = await transition(
            session,
            job_id,
            expected=JobStatus.FAILED,
            to=JobStatus.QUEUED,
            reason="retried by the user",
            actor=actor,
            values={"status_reason": None, "next_attempt_at": None, "published_at": None},
        )
    if not moved:
        raise BadInput(f"job {job_id} is no longer failed; nothing was changed")
    error = await announce(db, settings, job_id, bus.msg_id(job_id, place.newest_attempt))
    if error is not None:
        log.warning("retry_not_published", job_id=job_id, error=error)
    return error is None


async def read_attempt_file(
    transport: Transport,
    place: JobPlace,
    run: Attempt,
    name: str,
    offset: int,
    timeout: float,
    limit: int = READ_CHUNK_BYTES,
) -> bytes | None:
    """The file's bytes from `offset` (at most `limit`), exactly as written, or None when it
    does not exist (yet)."""
    assert place.target is not None
    try:
        result = await transport.run(
            place.target,
            read_file_script(run, name, offset=offset, hex=True, limit=limit),
            timeout=timeout,
            # `od` prints each byte as 3 characters, and a newline every 16 bytes.
            max_output=4 * max(0, limit) + 4096,
        )
    except TransportError as exc:
        raise ServiceUnavailable(f"cannot read {name} of job {place.job_id}: {exc}") from exc
    if result.exit_status == NO_FILE_EXIT:
        return None
    if not result.ok:
        raise ServiceUnavailable(
            f"reading {name} of job {place.job_id} failed: {result.stderr.strip()[:200]}"
        )
    try:
        return bytes.fromhex(result.stdout)
    except ValueError as exc:
        raise ServiceUnavailable(f"reading {name} of job {place.job_id}: garbled answer") from exc


async def read_progress(
    transport: Transport, place: JobPlace, *, timeout: float = PROGRESS_TIMEOUT_S
) -> tuple[dict[str, Any] | None, str | None]:
    """progress.json of the current attempt, or (None, why not) — never raises."""
    if place.target is None or place.attempt is None:
        return None, "not started"
    try:
        text = await read_attempt_file(
            transport, place, place.attempt, "progress.json", 0, timeout, STATE_FILE_BYTES
        )
    except ServiceUnavailable as exc:
        return None, str(exc)
    if text is None:
        return None, "no progress.json yet"
    return progress_view(text)


def progress_view(text: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """A progress.json as `job show` and the job API give it: (its values made safe to
    print and to serve as strict JSON, None), or (None, why it cannot be read). The file
    is the job's to write (docs/invariants.md, invariant 9): whatever it holds, this
    returns."""
    data = load_json(text)
    if data is None:
        return None, "progress.json is not readable JSON (being rewritten, or not JSON)"
    if not isinstance(data, dict):
        return None, "progress.json is not an object"
    safe = json_safe(data)
    assert isinstance(safe, dict)
    return safe, None


def json_safe(value: Any, depth: int = 0) -> Any:
    """A JSON value read from a job's file, made safe to print and to serve as strict JSON
    (no NaN or infinity, which a training whose loss diverged writes): non-finite numbers,
    integers beyond 2**53 and anything nested deeper than `SAFE_DEPTH` become None;
    strings lose their control characters and are cut to 1,000 characters."""
    if depth > SAFE_DEPTH:
        return None
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if -(2**53) <= value <= 2**53 else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return printable(value)[:1000]
    if isinstance(value, list):
        return [json_safe(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {printable(str(k))[:200]: json_safe(v, depth + 1) for k, v in value.items()}
    return None
