"""The dispatcher's NATS side: the pull subscription to `jobs.new`, fetching in batches
while earlier batches are handled, and answering each message exactly once.

A message is acked (`Replies.reply`) only once the database says what became of its job;
transient trouble (`TransientError`) is a nak with a jittered delay (`Replies.defer`); a
malformed message is terminated; a bug naks what is still unanswered, for a later
redelivery. What a batch means (claim, launch, record) is the dispatcher's
(`GlobalJobDispatcher.dispatch_batch`), handed in as `dispatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from scheduler import bus, metrics
from scheduler.aio import sleep_or_stop
from scheduler.daemon import run_loop
from scheduler.errors import error_line
from scheduler.logging import get_logger
from scheduler.validate import JOB_ID_RE

log = get_logger("dispatcher")

DB_NAK_DELAY_S = 2.0


class TransientError(Exception):
    """Something that may work in a moment (database unreachable, claims contended)."""


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


def db_error(exc: BaseException) -> str:
    """A database failure, in one line, as a launch or a nak reports it."""
    return "database: " + error_line(exc)


async def quietly(coro: Any) -> None:
    """Await an ack, nak or term; a lost one is logged (redelivery covers it)."""
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - the ack/nak is lost; redelivery covers it
        log.warning("ack_failed", error=str(exc) or type(exc).__name__)


class Replies:
    """The messages of one batch, each answered once (acked, nak'ed), and its start."""

    def __init__(self, started: float, stats: DispatchStats) -> None:
        self.started = started
        self.stats = stats
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

    async def reply(self, msg: Msg, outcome: str) -> None:
        """Ack: the database now says what became of the job."""
        self.answer(msg)
        metrics.observe_dispatch(self.elapsed(), outcome)
        await quietly(msg.ack())

    async def defer(self, msg: Msg, job_id: int, error: TransientError) -> None:
        """Nak with a jittered delay: the redelivery tries again."""
        self.answer(msg)
        metrics.observe_dispatch(self.elapsed(), "deferred")
        self.stats.nak += 1
        delay = DB_NAK_DELAY_S * (0.5 + random.random())
        log.warning("dispatch_deferred", job_id=job_id, error=str(error), retry_in_s=delay)
        await quietly(msg.nak(delay=delay))


Dispatch = Callable[[Sequence[tuple[Msg, int]], Replies], Awaitable[None]]
"""What a batch of (message, job id) means; answers every message through `Replies`."""


class Consumer:
    """The one durable pull consumer of `jobs.new`: batches fetched while earlier ones are
    handled, at most `max_in_flight` messages fetched and not yet answered."""

    def __init__(
        self,
        js: JetStreamContext,
        dispatch: Dispatch,
        stats: DispatchStats,
        *,
        batch: int,
        max_in_flight: int,
        fetch_timeout_s: float,
    ) -> None:
        self.js = js
        self.dispatch = dispatch
        self.stats = stats
        self.batch = batch
        self.max_in_flight = max_in_flight
        self.fetch_timeout_s = fetch_timeout_s
        self._sub: JetStreamContext.PullSubscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight = 0  # messages fetched and not yet answered

    async def subscribe(self, stop: asyncio.Event) -> bool:
        """Bind to the consumer, retrying until bound (True) or `stop` (False)."""
        backoff = bus.ReconnectBackoff()
        while not stop.is_set():
            try:
                self._sub = await bus.subscribe_dispatcher(self.js)
                return True
            except Exception as exc:  # noqa: BLE001 - JetStream not ready yet: retry
                log.warning("subscribe_failed", error=str(exc) or type(exc).__name__)
                await sleep_or_stop(stop, backoff.failed())
        return False

    async def consume(self, stop: asyncio.Event) -> None:
        """Fetch and hand out batches until `stop` (after `subscribe`)."""

        def failed(exc: Exception, failures: int) -> None:
            # NATS down or reconnecting: the loop waits (backoff) and fetches again.
            log.warning("fetch_failed", error=str(exc) or type(exc).__name__)

        await run_loop(self._fetch_once, stop, backoff=bus.ReconnectBackoff(), on_error=failed)

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the batches in flight."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)

    async def close(self) -> None:
        """Unbind from the consumer."""
        if self._sub is not None:
            with contextlib.suppress(Exception):  # closing anyway
                await self._sub.unsubscribe()

    async def _fetch_once(self) -> bool:
        """One tick of the loop: wait for room, fetch a batch and hand it to a task of its
        own, so that the next fetch overlaps it. Returns whether a batch came (binding
        anew when the consumer had been deleted); raises when the fetch failed otherwise
        (the loop backs off)."""
        assert self._sub is not None, "subscribe first"
        room = self.max_in_flight - self._in_flight
        if room <= 0:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            return False
        try:
            msgs = await self._sub.fetch(min(self.batch, room), timeout=self.fetch_timeout_s)
        except TimeoutError:
            return False
        except Exception:
            rebound = await self._rebind_if_gone(self._sub)
            if rebound is None:
                raise
            self._sub = rebound
            return False
        task = asyncio.create_task(self.handle_batch(msgs))
        self._in_flight += len(msgs)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._batch_done, len(msgs)))
        return True

    def _batch_done(self, size: int, task: asyncio.Task[None]) -> None:
        self._in_flight -= size
        self._tasks.discard(task)

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

    async def handle_batch(self, msgs: Sequence[Msg]) -> None:
        """Handle one fetched batch of `jobs.new` messages, answering each exactly once:
        ack (the database says what became of the job), nak (transient trouble) or term
        (malformed). A bug naks what is still unanswered, for a later redelivery."""
        replies = Replies(time.monotonic(), self.stats)
        jobs: list[tuple[Msg, int]] = []
        for msg in msgs:
            try:
                jobs.append((msg, parse_job_id(msg.data)))
            except ValueError as exc:
                self.stats.terminated += 1
                log.warning("message_terminated", reason=str(exc), subject=msg.subject)
                await quietly(msg.term())
        try:
            await self.dispatch(jobs, replies)
        except Exception:
            # A bug, not weather: leave the messages for redelivery later.
            log.exception("dispatch_crashed", job_ids=[job_id for _, job_id in jobs])
            for msg, _job_id in jobs:
                if replies.open(msg):
                    replies.answer(msg)
                    metrics.observe_dispatch(replies.elapsed(), "crashed")
                    await quietly(msg.nak(delay=DB_NAK_DELAY_S * 5))
