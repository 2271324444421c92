"""The dispatcher daemon: pull job ids from `jobs.new`, claim GPUs, launch over SSH.

Every dispatcher binds to the one durable pull consumer, so a message goes to one of them
at a time; Postgres decides the rest. Messages are fetched in batches, and each batch is
handled while the next one is fetched: claim all its jobs (one short transaction:
`claims.claim_batch`; jobs that fit nowhere go `pending` in it) → launch the claimed ones
concurrently (SSH, no transaction) → record all the pids (one guarded statement:
`claims.mark_running_batch`) → ack. A process runs one claim transaction at a time (its
batches would only contend for the same best-fit GPUs) and one running record at a time;
the batches that arrive meanwhile are claimed, or recorded, together in the next one (a
group commit), so transactions stay large even when messages trickle in one by one.
Launches overlap freely.

A message is acked only once the database says `running`, `pending` or `failed` (or the
job needs nothing from us); transient trouble with the database is a nak with a delay, and
a claim whose launch never got recorded is taken back by its lease
(`claims.expire_leases`).

Run it as `rlfleet dispatcher` or `python -m scheduler.dispatcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from sqlalchemy import select

from scheduler import bus, metrics
from scheduler.aio import sleep_or_stop
from scheduler.claims import (
    DEFAULT_LEASE_S,
    Claim,
    Launched,
    NoClaim,
    PortCollision,
    Running,
    claim_batch,
    mark_running_batch,
    record_group_ports,
    record_ranks,
)
from scheduler.daemon import run_loop
from scheduler.db import Database, is_unavailable
from scheduler.errors import error_line
from scheduler.gpus import refresh_available
from scheduler.groups import TOKEN_ENV, GroupPlace, group_launch, group_token, node_port_needs
from scheduler.jobspec import parse_data
from scheduler.kill import kill_attempt
from scheduler.leftovers import AttemptRecord, abandon_attempt
from scheduler.liveness import Liveness
from scheduler.logging import get_logger
from scheduler.remote.launch import (
    LaunchResult,
    LaunchSpec,
    launch_input,
    launch_script,
    parse_launch,
)
from scheduler.remote.rendezvous import (
    GroupLaunch,
    RankRendezvous,
    free_port_script,
    free_ports_script,
    parse_free_port,
    parse_free_ports,
)
from scheduler.remote.watchdog import DEFAULT_FENCE_AFTER_S, DEFAULT_FENCE_GRACE_S
from scheduler.settings import Settings
from scheduler.states import FailureReason, JobStatus
from scheduler.transport import Transport, TransportError, VMTarget, make_transport
from scheduler.validate import JOB_ID_RE

log = get_logger("dispatcher")

CONTENDED_RETRIES = 20
VM_CACHE_TTL_S = 15.0
DB_NAK_DELAY_S = 2.0
LEASE_MARGIN_S = 2.0
PORT_TRIES = 5
"""Port probes a group launch makes before it fails: each collision is another attempt's
port chosen on the same VM between our probe and our record."""


class TransientError(Exception):
    """Something that may work in a moment (database unreachable, claims contended)."""


def default_actor() -> str:
    """`dispatcher:<host>:<pid>`, cut to fit `job_events.actor`."""
    return f"dispatcher:{socket.gethostname()}:{os.getpid()}"[:64]


def parse_job_id(payload: bytes) -> int:
    """The job id a `jobs.new` message carries; ValueError with the reason if malformed."""
    try:
        text = payload.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError("payload is not UTF-8") from exc
    if not JOB_ID_RE.fullmatch(text):
        raise ValueError(f"payload {text[:40]!r} is not a job id")
    job_id = int(text)
    if not 0 < job_id < 2**63:
        raise ValueError(f"job id {job_id} is out of range")
    return job_id


@dataclass
class DispatchStats:
    """What this dispatcher did, for logs and benchmarks."""

    launched: int = 0
    pending: int = 0
    skipped: int = 0
    launch_failed: int = 0
    terminated: int = 0
    nak: int = 0
    contended: int = 0  # claims tried again because other claimers held the rows
    rejected: int = 0  # job rows the launch cannot use, failed with config_error


class _Replies:
    """The messages of one batch that were answered (acked, nak'ed), and its start."""

    def __init__(self, started: float) -> None:
        self.started = started
        self._answered: set[int] = set()

    def answer(self, msg: Msg) -> None:
        """Note that `msg` got its answer."""
        self._answered.add(id(msg))

    def open(self, msg: Msg) -> bool:
        """Whether `msg` still waits for its answer."""
        return id(msg) not in self._answered

    def elapsed(self) -> float:
        """Seconds since the batch was fetched."""
        return time.monotonic() - self.started


@dataclass(frozen=True)
class _Launch:
    """A claimed attempt its VM started, and the message that asked for it."""

    msg: Msg
    claim: Claim
    target: VMTarget
    pid: int
    path: str | None
    """The attempt's absolute directory, as its launch reported it."""


In = TypeVar("In")
Out = TypeVar("Out")


class GroupCommit(Generic[In, Out]):
    """Runs a batch operation one call at a time, and the items that arrive while a call
    runs together in the next one (a group commit). Under a steady trickle of messages
    each fetch brings only one or two jobs; this keeps the transactions large anyway.
    The dispatcher has two: one for claim batches, one for marking launched jobs running."""

    def __init__(self, run: Callable[[list[In]], Awaitable[list[Out]]], *, most: int) -> None:
        self._run = run
        self._most = most
        self._waiting: list[tuple[list[In], asyncio.Future[list[Out]]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, items: list[In]) -> list[Out]:
        """One result per item, in order; raises what the batch operation raised."""
        future: asyncio.Future[list[Out]] = asyncio.get_running_loop().create_future()
        self._waiting.append((items, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            group = [self._waiting.pop(0)]
            size = len(group[0][0])
            while self._waiting and size + len(self._waiting[0][0]) <= self._most:
                group.append(self._waiting.pop(0))
                size += len(group[-1][0])
            try:
                results = await self._run([item for items, _ in group for item in items])
            except Exception as exc:  # noqa: BLE001 - handed to every caller of this round
                for _items, future in group:
                    if not future.done():
                        future.set_exception(exc)
                continue
            start = 0
            for items, future in group:
                if not future.done():
                    future.set_result(results[start : start + len(items)])
                start += len(items)


class GlobalJobDispatcher:
    """Consumes `jobs.new` and turns queued jobs into running ones."""

    def __init__(
        self,
        db: Database,
        js: JetStreamContext,
        transport: Transport,
        *,
        actor: str | None = None,
        batch: int = 32,
        max_in_flight: int = 64,
        lease_s: float = DEFAULT_LEASE_S,
        launch_timeout_s: float = 30.0,
        kill_grace_s: float = 10.0,
        fetch_timeout_s: float = 1.0,
        fence_after_s: float = DEFAULT_FENCE_AFTER_S,
        fence_grace_s: float = DEFAULT_FENCE_GRACE_S,
    ) -> None:
        self.db = db
        self.js = js
        self.transport = transport
        self.actor = actor or default_actor()
        self.batch = batch
        self.max_in_flight = max_in_flight
        self.lease_s = lease_s
        self.launch_timeout_s = launch_timeout_s
        self.kill_grace_s = kill_grace_s
        self.fetch_timeout_s = fetch_timeout_s
        self.fence_after_s = fence_after_s
        self.fence_grace_s = fence_grace_s
        self.stats = DispatchStats()
        self._vms: dict[int, tuple[VMTarget, float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0  # messages fetched and not yet answered
        self._touched_vms: set[int] = set()
        self._vms_lock = asyncio.Lock()
        self._claims = GroupCommit(self._claim_batch, most=4 * batch)
        self._runs = GroupCommit(self._mark_running, most=4 * batch)

    # ---------------------------------------------------------------- the loop

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Fetch and handle messages until `stop` is set, then finish the ones in flight.

        `ready` is set once bound to the consumer."""
        subscribed = await self._subscribe(stop)
        if subscribed is None:
            return
        sub: JetStreamContext.PullSubscription = subscribed
        # systemd's READY=1 and watchdog pings come from `serve`, driven by `ready`.
        if ready is not None:
            ready.set()
        log.info("dispatcher_ready", actor=self.actor, max_in_flight=self.max_in_flight)
        counter = asyncio.create_task(self._refresh_counts(stop))

        async def fetch() -> bool:
            nonlocal sub
            fetched, sub = await self._fetch_once(sub)
            return fetched

        def failed(exc: Exception, failures: int) -> None:
            # NATS down or reconnecting: the loop waits (backoff) and fetches again.
            log.warning("fetch_failed", error=str(exc) or type(exc).__name__)

        await run_loop(fetch, stop, backoff=bus.ReconnectBackoff(), on_error=failed)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.launch_timeout_s + 5)
        counter.cancel()
        with contextlib.suppress(BaseException):
            await counter
        await self._flush_counts()
        with contextlib.suppress(Exception):  # closing anyway
            await sub.unsubscribe()

    async def _fetch_once(
        self, sub: JetStreamContext.PullSubscription
    ) -> tuple[bool, JetStreamContext.PullSubscription]:
        """One tick of the loop: wait for room, fetch a batch and hand it to a task of its
        own, so that the next fetch overlaps it. Returns whether a batch came and the
        binding to fetch from next (a new one when the consumer had been deleted); raises
        when the fetch failed otherwise (the loop backs off)."""
        room = self.max_in_flight - self._in_flight
        if room <= 0:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            return False, sub
        try:
            msgs = await sub.fetch(min(self.batch, room), timeout=self.fetch_timeout_s)
        except TimeoutError:
            return False, sub
        except Exception:
            rebound = await self._rebind_if_gone(sub)
            if rebound is None:
                raise
            return False, rebound
        task = asyncio.create_task(self.handle_batch(msgs))
        self._in_flight += len(msgs)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._batch_done, len(msgs)))
        return True, sub

    def _batch_done(self, size: int, task: asyncio.Task[None]) -> None:
        self._in_flight -= size
        self._tasks.discard(task)

    async def _refresh_counts(self, stop: asyncio.Event) -> None:
        """Recount `vms.available_gpus` of the VMs claimed on, at most twice a second."""
        while not stop.is_set():
            await sleep_or_stop(stop, 0.5)
            await self._flush_counts()

    async def _flush_counts(self) -> None:
        if not self._touched_vms:
            return
        vm_ids, self._touched_vms = self._touched_vms, set()
        try:
            await refresh_available(self.db, vm_ids)
        except Exception as exc:  # noqa: BLE001 - a count for display; the poller redoes it
            log.warning("count_refresh_failed", error=str(exc) or type(exc).__name__)

    async def _subscribe(self, stop: asyncio.Event) -> JetStreamContext.PullSubscription | None:
        backoff = bus.ReconnectBackoff()
        while not stop.is_set():
            try:
                return await bus.subscribe_dispatcher(self.js)
            except Exception as exc:  # noqa: BLE001 - JetStream not ready yet: retry
                log.warning("subscribe_failed", error=str(exc) or type(exc).__name__)
                await sleep_or_stop(stop, backoff.failed())
        return None

    async def _rebind_if_gone(
        self, sub: JetStreamContext.PullSubscription
    ) -> JetStreamContext.PullSubscription | None:
        """After a failed fetch: when the durable consumer is gone (deleted by hand, or
        with its stream), create it again and bind to it; None when it is not gone or
        cannot be recreated now (the caller backs off and fetches again)."""
        if not await bus.consumer_missing(self.js):
            return None
        log.warning("consumer_missing", stream=bus.STREAM, consumer=bus.CONSUMER)
        try:
            fresh = await bus.subscribe_dispatcher(self.js)
        except Exception as exc:  # noqa: BLE001 - NATS trouble: the next failure retries
            log.warning("consumer_recreate_failed", error=str(exc) or type(exc).__name__)
            return None
        with contextlib.suppress(Exception):  # the old binding is dead anyway
            await sub.unsubscribe()
        log.info("consumer_rebound", stream=bus.STREAM, consumer=bus.CONSUMER)
        return fresh

    # ---------------------------------------------------------------- one batch

    async def handle_batch(self, msgs: Sequence[Msg]) -> None:
        """Handle one fetched batch of `jobs.new` messages, answering each exactly once:
        ack (the database says what became of the job), nak (transient trouble) or term
        (malformed). A bug naks what is still unanswered, for a later redelivery."""
        replies = _Replies(time.monotonic())
        jobs: list[tuple[Msg, int]] = []
        for msg in msgs:
            try:
                jobs.append((msg, parse_job_id(msg.data)))
            except ValueError as exc:
                self.stats.terminated += 1
                log.warning("message_terminated", reason=str(exc), subject=msg.subject)
                await _quietly(msg.term())
        try:
            await self.dispatch_batch(jobs, replies)
        except Exception:
            # A bug, not weather: leave the messages for redelivery later.
            log.exception("dispatch_crashed", job_ids=[job_id for _, job_id in jobs])
            for msg, _job_id in jobs:
                if replies.open(msg):
                    replies.answer(msg)
                    metrics.observe_dispatch(replies.elapsed(), "crashed")
                    await _quietly(msg.nak(delay=DB_NAK_DELAY_S * 5))

    async def dispatch_batch(self, jobs: Sequence[tuple[Msg, int]], replies: _Replies) -> None:
        """Claim every job in one transaction → launch the claimed ones concurrently (no
        transaction) → record the launched ones `running` in one statement."""
        results = await self._claim_all([job_id for _msg, job_id in jobs])
        claimed: list[tuple[Msg, Claim]] = []
        for (msg, job_id), result in zip(jobs, results, strict=True):
            if isinstance(result, Claim):
                self._touched_vms.add(result.vm_id)
                claimed.append((msg, result))
            elif isinstance(result, TransientError):
                await self._defer(replies, msg, job_id, result)
            else:
                await self._reply(replies, msg, self._not_claimed(result))
        if claimed:
            await self._launch_all(claimed, replies)

    async def _claim_all(self, job_ids: list[int]) -> list[Claim | NoClaim | TransientError]:
        """One result per job id: the batch claim, retried for the jobs whose free GPUs
        other claimers held locked (their commit is a few milliseconds away)."""
        results: list[Claim | NoClaim | TransientError | None] = [None] * len(job_ids)
        todo = list(range(len(job_ids)))
        for attempt in range(CONTENDED_RETRIES):
            if attempt:
                await asyncio.sleep(0.005 + random.random() * 0.02)
            try:
                # One claim transaction at a time per process (this dispatcher's batches
                # would otherwise contend for the same best-fit GPU rows), and the batches
                # that wait meanwhile are claimed together in the next one.
                batch = await self._claims.submit([job_ids[i] for i in todo])
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                # Nothing of this round was committed; earlier rounds' claims stand.
                for i in todo:
                    results[i] = TransientError(_db_error(exc))
                todo = []
                break
            retry: list[int] = []
            for i, result in zip(todo, batch, strict=True):
                if isinstance(result, NoClaim) and result.contended:
                    retry.append(i)
                elif isinstance(result, NoClaim) and result.waiting:
                    # Redelivered a little later (nak with delay): the kill takes a tick.
                    results[i] = TransientError(result.reason or "waiting")
                else:
                    results[i] = result
            todo = retry
            self.stats.contended += len(retry)
            if not todo:
                break
        for i in todo:
            results[i] = TransientError("free GPUs stayed locked by other claimers")
        return [r for r in results if r is not None]

    async def _claim_batch(self, job_ids: list[int]) -> list[Claim | NoClaim]:
        return await claim_batch(self.db, job_ids, actor=self.actor, lease_s=self.lease_s)

    async def _mark_running(self, batch: list[Launched]) -> list[Running | None]:
        async with self.db.engine.begin() as conn:  # hot path: no ORM session
            moved = await mark_running_batch(conn, batch, actor=self.actor)
        return [moved.get(x.job_id) for x in batch]

    def _not_claimed(self, result: NoClaim) -> str:
        """Count and log a job that claimed nothing; returns the outcome for metrics."""
        if result.status == JobStatus.PENDING and result.moved_to_pending:
            self.stats.pending += 1
            log.info("job_pending", job_id=result.job_id, reason=result.reason)
            return "pending"
        if result.rejected:  # a row the launch cannot use: failed with config_error
            self.stats.rejected += 1
            return "failed"
        self.stats.skipped += 1
        log.info("job_skipped", job_id=result.job_id, status=result.status, reason=result.reason)
        return "skipped"

    async def _launch_all(self, claimed: list[tuple[Msg, Claim]], replies: _Replies) -> None:
        """Launch every claim concurrently, then settle failures and record the rest."""
        try:
            targets = [await self._target(claim.vm_id) for _msg, claim in claimed]
        except TransientError as exc:
            for msg, claim in claimed:  # the leases bring the claims back
                await self._defer(replies, msg, claim.job_id, exc)
            return
        outcomes = await asyncio.gather(
            *(
                self._launch(claim, target)
                for (_msg, claim), target in zip(claimed, targets, strict=True)
            )
        )
        launched: list[_Launch] = []
        failed = []
        for (msg, claim), target, outcome in zip(claimed, targets, outcomes, strict=True):
            if isinstance(outcome, LaunchResult):
                launched.append(_Launch(msg, claim, target, outcome.pid, outcome.path))
            else:
                failed.append(self._fail(replies, msg, claim, target, outcome))
        await asyncio.gather(*failed)
        if launched:
            await self._record_running(launched, replies)

    async def _launch(self, claim: Claim, target: VMTarget) -> LaunchResult | str:
        """Start the claimed attempt on its VM (every rank, for a multi-node job): its
        (rank 0's) pid and directory, or why it did not start."""
        if claim.nodes and claim.roles is not None:
            return await self._launch_group_gang(claim)
        if claim.nodes:
            return await self._launch_gang(claim)
        if claim.roles is not None:
            return await self._launch_group(claim, target)
        return await self._launch_rank(claim, target, claim.gpu_indices, claim.gpu_uuids)

    async def _launch_group(self, claim: Claim, target: VMTarget) -> LaunchResult | str:
        """Launch a job group's attempt: choose its roles' ports on the VM (recorded, unique
        per VM; a probe whose answer collides with another attempt's is asked again), then
        start the supervisor that runs the roles (`scheduler/supervisor.py`)."""
        group = parse_data(claim.roles)  # checked by the claim (rowcheck.job_row_problem)
        ports = await self._choose_ports_on(claim, [(target, node_port_needs(group)[0])])
        if isinstance(ports, str):
            return ports
        place = _group_place(claim, target, claim.gpu_indices, claim.gpu_uuids)
        launch = group_launch(group, place, ports)
        secret = ((TOKEN_ENV, group_token()),)  # this attempt's, in job.env only
        return await self._launch_rank(
            claim, target, claim.gpu_indices, claim.gpu_uuids, group=launch, secret_env=secret
        )

    async def _choose_ports_on(
        self, claim: Claim, wanted: Sequence[tuple[VMTarget, list[tuple[str, str]]]]
    ) -> dict[tuple[str, str], int] | str:
        """Free ports for every (role, name) on the VM that runs it, probed on all the VMs
        at once (SSH, no transaction) and recorded for this attempt in one transaction; a
        probe answer that collides with another attempt's record is asked again."""
        asked = [(target, needs) for target, needs in wanted if needs]
        if not asked:
            return {}
        for _try in range(PORT_TRIES):
            probes = await asyncio.gather(*(self._probe_ports(t, n) for t, n in asked))
            errors = [p for p in probes if isinstance(p, str)]
            if errors:
                return "; ".join(errors)
            chosen = {key: port for p in probes if isinstance(p, dict) for key, port in p.items()}
            rows = [
                (target.id, role, name, chosen[(role, name)])
                for target, needs in asked
                for role, name in needs
            ]
            try:
                async with self.db.engine.begin() as conn:
                    await record_group_ports(conn, claim.job_id, claim.attempt, rows)
            except PortCollision:
                continue
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                return _db_error(exc)
            return chosen
        return f"no free ports: {PORT_TRIES} probes collided with other attempts' ports"

    async def _probe_ports(
        self, target: VMTarget, needs: list[tuple[str, str]]
    ) -> dict[tuple[str, str], int] | str:
        """Ask `target` for as many free ports as `needs` has (one probe, so they differ)."""
        try:
            probe = await self.transport.run(
                target,
                free_ports_script(target.python, len(needs)),
                timeout=self.launch_timeout_s,
            )
        except TransportError as exc:
            return f"choosing ports on {target.name}: {exc or type(exc).__name__}"
        found = parse_free_ports(probe.stdout)
        if len(found) < len(needs):
            why = _last_line(probe.stderr) or f"exit {probe.exit_status}"
            return f"no free ports on {target.name}: {why}"
        return dict(zip(needs, found, strict=False))

    async def _launch_group_gang(self, claim: Claim) -> LaunchResult | str:
        """Launch a job group spread over several VMs (`GroupSpec.layout`, one claimed node
        per VM): choose on each VM the ports of the roles whose rank 0 runs there (named
        ports, and the rendezvous port of a role on several nodes), then start on every VM
        at once a supervisor for its own roles, which knows every role's address and
        ports. Like a multi-node job, any VM that does not start fails the whole attempt."""
        group = parse_data(claim.roles)  # checked by the claim (rowcheck.job_row_problem)
        layout = group.layout()
        if len(layout) != len(claim.nodes):
            return f"the group runs on {len(layout)} VMs, the claim has {len(claim.nodes)}"
        try:
            targets = [await self._target(node.vm_id) for node in claim.nodes]
        except (TransientError, RuntimeError) as exc:
            return str(exc)
        wanted = list(zip(targets, node_port_needs(group), strict=True))
        ports = await self._choose_ports_on(claim, wanted)
        if isinstance(ports, str):
            return ports
        addresses = [target.training_address for target in targets]
        secret = ((TOKEN_ENV, group_token()),)  # one per attempt, the same on every VM
        launches = []
        for index, (node, target) in enumerate(zip(claim.nodes, targets, strict=True)):
            place = _group_place(claim, target, node.gpu_indices, node.gpu_uuids)
            launch = group_launch(group, place, ports, node=index, node_addresses=addresses)
            launches.append(
                self._launch_rank(
                    claim,
                    target,
                    node.gpu_indices,
                    node.gpu_uuids,
                    group=launch,
                    secret_env=secret,
                )
            )
        return await self._settle_ranks(claim, targets, list(await asyncio.gather(*launches)))

    async def _launch_gang(self, claim: Claim) -> LaunchResult | str:
        """Launch every rank of a multi-node attempt concurrently, after choosing the
        rendezvous port on rank 0's VM; record each rank's pid and directory (a short
        transaction after the SSH calls). Any rank that does not start fails the whole
        attempt: its caller abandons it, and every rank becomes a leftover to kill."""
        try:
            targets = [await self._target(node.vm_id) for node in claim.nodes]
        except (TransientError, RuntimeError) as exc:
            return str(exc)
        try:
            probe = await self.transport.run(
                targets[0], free_port_script(targets[0].python), timeout=self.launch_timeout_s
            )
        except TransportError as exc:
            return f"rank 0 ({targets[0].name}): {exc or type(exc).__name__}"
        addrs = tuple(target.training_address for target in targets)
        port = parse_free_port(probe.stdout)
        if port is None:
            why = _last_line(probe.stderr) or f"exit {probe.exit_status}"
            return f"rank 0 ({targets[0].name}): no free port: {why}"
        outcomes = await asyncio.gather(
            *(
                self._launch_rank(
                    claim,
                    target,
                    node.gpu_indices,
                    node.gpu_uuids,
                    RankRendezvous(node.rank, addrs, port),
                )
                for node, target in zip(claim.nodes, targets, strict=True)
            )
        )
        return await self._settle_ranks(claim, targets, list(outcomes))

    async def _settle_ranks(
        self,
        claim: Claim,
        targets: Sequence[VMTarget],
        outcomes: Sequence[LaunchResult | str],
    ) -> LaunchResult | str:
        """Every rank started: record each one's pid and directory (a short transaction
        after the SSH calls) and return rank 0's; else why some did not start."""
        errors = [
            f"rank {node.rank} ({target.name}): {outcome}"
            for node, target, outcome in zip(claim.nodes, targets, outcomes, strict=True)
            if not isinstance(outcome, LaunchResult)
        ]
        if errors:
            return "; ".join(errors)
        launched = [o for o in outcomes if isinstance(o, LaunchResult)]
        try:
            async with self.db.engine.begin() as conn:
                await record_ranks(
                    conn,
                    claim.job_id,
                    claim.attempt,
                    [(n.rank, o.pid, o.path) for n, o in zip(claim.nodes, launched, strict=True)],
                )
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            return _db_error(exc)
        return launched[0]

    async def _launch_rank(
        self,
        claim: Claim,
        target: VMTarget,
        gpu_indices: Sequence[int],
        gpu_uuids: Sequence[str],
        node: RankRendezvous | None = None,
        *,
        group: GroupLaunch | None = None,
        secret_env: tuple[tuple[str, str], ...] = (),
    ) -> LaunchResult | str:
        """Start one rank of the claimed attempt on `target`: its pid and directory, or
        why it did not start. `secret_env` (a group's token) goes with the job's own
        variables into job.env (mode 0600, through stdin), never on a command line."""
        spec = LaunchSpec(
            run=claim.run,
            python=target.python,
            entrypoint=target.entrypoint,
            gpu_indices=gpu_indices,
            gpu_uuids=gpu_uuids,
            model=claim.model,
            dataset=claim.dataset,
            reward_functions=claim.reward_functions,
            output_dir=claim.output_dir,
            extra_args=claim.extra_args,
            env=claim.env + secret_env,
            fence_after_s=self.fence_after_s,
            fence_grace_s=self.fence_grace_s,
            node=node,
            group=group,
        )
        try:
            result = await self.transport.run(
                target,
                launch_script(spec),
                timeout=self.launch_timeout_s,
                input=launch_input(spec),
            )
        except TransportError as exc:
            return str(exc) or type(exc).__name__
        launched = parse_launch(result.stdout, claim.run)
        if launched is None:
            return _last_line(result.stderr) or f"launch exited {result.exit_status}"
        return launched

    async def _record_running(self, launched: list[_Launch], replies: _Replies) -> None:
        """Move every launched attempt `starting → running` in one statement, then ack;
        an attempt whose job moved on meanwhile is killed."""
        batch = [
            Launched(
                x.claim.job_id,
                x.claim.attempt,
                x.pid,
                f"pid {x.pid} on {x.target.name}",
                attempt_dir=x.path,
            )
            for x in launched
        ]
        try:
            moved = {
                x.job_id: running
                for x, running in zip(batch, await self._runs.submit(batch), strict=True)
                if running is not None
            }
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            # The processes run; the leases will bring the claims back if we never can.
            error = TransientError(_db_error(exc))
            for x in launched:
                await self._defer(replies, x.msg, x.claim.job_id, error)
            return
        superseded = []
        for x in launched:
            running = moved.get(x.claim.job_id)
            if running is None:
                superseded.append(self._supersede(replies, x))
                continue
            metrics.observe_queue_wait(running.queued_at, running.starting_at)
            metrics.observe_running(running.submitted_at, running.running_at)
            self.stats.launched += 1
            log.info(
                "job_running",
                job_id=x.claim.job_id,
                vm=x.target.name,
                attempt=x.claim.attempt,
                pid=x.pid,
                gpus=x.claim.gpu_indices,
            )
            await self._reply(replies, x.msg, "running")
        await asyncio.gather(*superseded)

    async def _supersede(self, replies: _Replies, x: _Launch) -> None:
        """Cancelled, or the lease expired, while we launched: this attempt must not run."""
        bound = log.bind(job_id=x.claim.job_id, vm=x.target.name, attempt=x.claim.attempt)
        bound.warning("launch_superseded", pid=x.pid)
        await self._kill_quietly(x.claim, x.target, x.path)
        self.stats.skipped += 1
        await self._reply(replies, x.msg, "superseded")

    async def _fail(
        self, replies: _Replies, msg: Msg, claim: Claim, target: VMTarget, error: str
    ) -> None:
        """Record a launch that did not start, then ack (or nak when the DB is away)."""
        try:
            await self._launch_failed(claim, target, error)
        except TransientError as exc:
            await self._defer(replies, msg, claim.job_id, exc)
            return
        await self._reply(replies, msg, "failed")

    async def _reply(self, replies: _Replies, msg: Msg, outcome: str) -> None:
        """Ack: the database now says what became of the job."""
        replies.answer(msg)
        metrics.observe_dispatch(replies.elapsed(), outcome)
        await _quietly(msg.ack())

    async def _defer(self, replies: _Replies, msg: Msg, job_id: int, error: TransientError) -> None:
        """Nak with a jittered delay: the redelivery tries again."""
        replies.answer(msg)
        metrics.observe_dispatch(replies.elapsed(), "deferred")
        self.stats.nak += 1
        delay = DB_NAK_DELAY_S * (0.5 + random.random())
        log.warning("dispatch_deferred", job_id=job_id, error=str(error), retry_in_s=delay)
        await _quietly(msg.nak(delay=delay))

    async def _launch_failed(self, claim: Claim, target: VMTarget, error: str) -> None:
        bound = log.bind(job_id=claim.job_id, vm=target.name, attempt=claim.attempt)
        bound.warning("launch_failed", error=error)
        reason = f"launch failed: {error}"[:500]
        try:
            async with self.db.transaction() as session:
                # The launch may have started after all (a timeout, a dropped link): its
                # attempt is a leftover, its GPUs out of use until it is known to be dead.
                moved = await abandon_attempt(
                    session,
                    AttemptRecord(
                        claim.job_id,
                        claim.attempt,  # not the next attempt, if the lease ran out
                        target.id,
                        claim.gpu_indices,
                        claim.gpu_uuids,
                        claim.token,
                    ),
                    expected=JobStatus.STARTING,
                    to=JobStatus.FAILED,
                    reason=reason,
                    actor=self.actor,
                    leftover="launch_failed",
                    failure_reason=FailureReason.LAUNCH_FAILED.value,
                )
        except Exception as exc:
            if is_unavailable(exc):
                raise TransientError(_db_error(exc)) from exc
            raise
        if moved:
            self.stats.launch_failed += 1
        else:
            # Cancelled, or its lease ran out, while the launch was on the wire: a launch
            # that a kill fenced off fails this way, and nothing of it runs.
            self.stats.skipped += 1
            bound.info("launch_superseded", error=error)

    async def _kill_quietly(self, claim: Claim, target: VMTarget, path: str | None) -> None:
        """Kill a superseded attempt. Its job has moved on without it, and whoever moved it
        (cancel, an expired lease) recorded this attempt as a leftover, which keeps its GPUs
        blocked until the attempt is known dead: a failed kill here is retried by the requeue
        manager."""
        kill = await kill_attempt(
            self.transport,
            target,
            claim.run.located(path),
            grace_s=self.kill_grace_s,
            launched=True,
        )
        if not kill.dead:
            log.warning("kill_failed", job_id=claim.job_id, vm=target.name, outcome=kill.describe())

    async def _target(self, vm_id: int) -> VMTarget:
        """The VM's connection fields, from a cache of every VM refreshed in one query."""
        cached = self._vms.get(vm_id)
        if cached is not None and time.monotonic() - cached[1] < VM_CACHE_TTL_S:
            return cached[0]
        async with self._vms_lock:  # one reload for all the claims that missed at once
            cached = self._vms.get(vm_id)
            if cached is None or time.monotonic() - cached[1] >= VM_CACHE_TTL_S:
                await self._load_targets()
        cached = self._vms.get(vm_id)
        if cached is None:
            raise RuntimeError(f"VM {vm_id} vanished under a claim")
        return cached[0]

    async def _load_targets(self) -> None:
        try:
            async with self.db.transaction() as session:
                rows = (await session.execute(select(*VMTarget.columns()))).all()
        except Exception as exc:
            if is_unavailable(exc):
                raise TransientError(_db_error(exc)) from exc
            raise
        now = time.monotonic()
        self._vms = {row.id: (VMTarget.from_row(row), now) for row in rows}


def _group_place(
    claim: Claim, target: VMTarget, gpu_indices: Sequence[int], gpu_uuids: Sequence[str]
) -> GroupPlace:
    """Where a group's attempt runs on `target`, with the GPUs claimed there (UUIDs, else
    indices for a claim made before UUIDs were recorded)."""
    return GroupPlace(
        python=target.python,
        entrypoint=target.entrypoint,
        address=target.training_address,
        gpus=list(gpu_uuids) or [str(i) for i in gpu_indices],
        output_dir=claim.output_dir,
        attempt=claim.attempt,
    )


def _last_line(text: str) -> str:
    """The launch's stderr says what went wrong last."""
    text = text.strip()
    return text.splitlines()[-1][:300] if text else ""


def _db_error(exc: BaseException) -> str:
    return "database: " + error_line(exc)


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - the ack/nak is lost; redelivery covers it
        log.warning("ack_failed", error=str(exc) or type(exc).__name__)


async def run_dispatcher(
    settings: Settings,
    stop: asyncio.Event,
    *,
    ready: asyncio.Event | None = None,
    transport: Transport | None = None,
    **options: Any,
) -> None:
    """Connect to Postgres and NATS and dispatch until `stop`."""
    nc = await bus.connect_until(settings, name="rlfleet-dispatcher", stop=stop)
    if nc is None:
        return
    db = Database(settings.database_url, pool_size=10)
    own_transport = transport is None
    transport = transport or make_transport()
    try:
        await GlobalJobDispatcher(db, nc.jetstream(), transport, **options).run(stop, ready)
    finally:
        await nc.close()
        if own_transport:
            await transport.close()
        await db.dispose()


async def run(
    settings: Settings, stop: asyncio.Event, ready: asyncio.Event, **options: Any
) -> None:
    """The dispatcher daemon: dispatch until `stop`, `ready` set once subscribed.
    `options` are `GlobalJobDispatcher`'s knobs; the fence knobs default to the
    environment's (`Liveness.from_env`). `rlfleet dispatcher` and `rlfleet up` run this."""
    knobs = Liveness.from_env()
    options.setdefault("fence_after_s", knobs.fence_after_s)
    options.setdefault("fence_grace_s", knobs.fence_grace_s)
    await run_dispatcher(settings, stop, ready=ready, **options)
