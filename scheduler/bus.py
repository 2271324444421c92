"""The NATS side: the `jobs.new` subject, the RLFLEET_JOBS stream and its consumer.

Users publish job ids with a plain `nc.publish("jobs.new", b"<id>")`; the stream captures
them, and every dispatcher pulls from the one durable consumer `dispatcher`, so each id is
handed to one dispatcher at a time. Postgres stays the truth: a message only says "look
at this job".
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from scheduler.logging import get_logger
from scheduler.settings import Settings, redact_url

SUBJECT_NEW = "jobs.new"
STREAM = "RLFLEET_JOBS"
CONSUMER = "dispatcher"
DUPLICATE_WINDOW_S = 120.0
ACK_WAIT_S = 30.0

log = get_logger("bus")


def stream_config() -> StreamConfig:
    """The wanted configuration of the RLFLEET_JOBS stream."""
    return StreamConfig(
        name=STREAM,
        subjects=[SUBJECT_NEW],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


def consumer_config() -> ConsumerConfig:
    """The wanted configuration of the shared durable pull consumer."""
    return ConsumerConfig(
        durable_name=CONSUMER,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT_S,
        max_deliver=-1,
        max_ack_pending=10_000,
        filter_subject=SUBJECT_NEW,
    )


def _connect_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if settings.nats_creds:
        options["user_credentials"] = settings.nats_creds
    if settings.nats_token:
        options["token"] = settings.nats_token
    if settings.nats_user:
        options["user"] = settings.nats_user
        options["password"] = settings.nats_password or ""
    if settings.nats_tls_ca:
        options["tls"] = ssl.create_default_context(cafile=settings.nats_tls_ca)
    return options


class ReconnectBackoff:
    """The wait before the next reconnect attempt: `base_s` doubled for each attempt that
    failed in a row, capped at `max_s`, with ±25 % jitter so that a fleet of daemons does
    not knock on a restarted server all at once. Back to `base_s` once connected."""

    def __init__(self, base_s: float = 0.5, max_s: float = 10.0) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.failures = 0

    def failed(self) -> float:
        """Count one failed attempt; the wait before the next one."""
        self.failures += 1
        wait = min(self.max_s, self.base_s * 2 ** min(self.failures - 1, 30))
        return wait * random.uniform(0.75, 1.25)

    def reset(self) -> float:
        """Connected again: the wait for the next outage's first retry."""
        self.failures = 0
        return self.base_s


def _client(
    settings: Settings, name: str, forever: bool, backoff: ReconnectBackoff
) -> tuple[NATS, dict[str, Any]]:
    """A NATS client and the options to connect it with, its callbacks wired to log."""
    bound = log.bind(client=name, servers=redact_url(settings.nats_url))
    nc = NATS()

    async def on_error(exc: Exception) -> None:
        # A fail-fast client reports its one error itself; a daemon logs each one.
        if not forever:
            return
        error = str(exc) or type(exc).__name__
        if nc.is_connected:
            bound.warning("nats_error", error=error)
            return
        # A (re)connect attempt failed. nats-py reads this option before each wait.
        wait = backoff.failed()
        nc.options["reconnect_time_wait"] = wait
        bound.warning("nats_connect_failed", error=error, retry_in_s=round(wait, 2))

    async def on_disconnect() -> None:
        if nc.is_closed:  # our own close(): nothing went wrong
            return
        bound.warning("nats_disconnected")

    async def on_reconnect() -> None:
        nc.options["reconnect_time_wait"] = backoff.reset()
        bound.info("nats_reconnected")

    # nats-py loops for ever on the first connect with max_reconnect_attempts=0, so a
    # fail-fast client makes one more attempt at most.
    options: dict[str, Any] = {
        "servers": settings.nats_servers,
        "name": name,
        "connect_timeout": 2,
        "allow_reconnect": forever,
        "max_reconnect_attempts": -1 if forever else 1,
        "reconnect_time_wait": backoff.base_s if forever else 0.1,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        **_connect_options(settings),
    }
    return nc, options


async def connect(settings: Settings, *, name: str) -> NATS:
    """Connect to NATS, failing fast: for the CLI, where an unreachable server is one
    clear error."""
    nc, options = _client(settings, name, False, ReconnectBackoff())
    await nc.connect(**options)
    return nc


async def connect_until(
    settings: Settings,
    *,
    name: str,
    stop: asyncio.Event,
    backoff: ReconnectBackoff | None = None,
) -> NATS | None:
    """Connect a daemon to NATS: try for ever, waiting longer after each failed attempt
    (`ReconnectBackoff`), and reconnect for ever once connected. Gives up, returning None,
    only when `stop` is set first (a daemon told to stop while NATS is away)."""
    backoff = backoff or ReconnectBackoff()
    nc, options = _client(settings, name, True, backoff)
    connecting = asyncio.ensure_future(nc.connect(**options))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if connecting.done():
        connecting.result()  # re-raises what nats-py gives up with (bad credentials)
        nc.options["reconnect_time_wait"] = backoff.reset()
        return nc
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    with contextlib.suppress(Exception):
        await nc.close()
    return None


async def ensure_stream(js: JetStreamContext) -> None:
    """Create the stream and consumer, or bring their configuration up to date."""
    wanted = stream_config()
    try:
        info = await js.stream_info(STREAM)
    except NotFoundError:
        await js.add_stream(wanted)
        log.info("stream_created", stream=STREAM)
    else:
        current = info.config
        if (
            current.subjects != wanted.subjects
            or current.duplicate_window != wanted.duplicate_window
            or current.discard != wanted.discard
        ):
            await js.update_stream(wanted)
            log.info("stream_updated", stream=STREAM)
    wanted_consumer = consumer_config()
    try:
        consumer = await js.consumer_info(STREAM, CONSUMER)
    except NotFoundError:
        await js.add_consumer(STREAM, wanted_consumer)
        log.info("consumer_created", stream=STREAM, consumer=CONSUMER)
    else:
        if _consumer_differs(consumer.config, wanted_consumer):
            # A create request for an existing durable updates its editable fields.
            await js.add_consumer(STREAM, wanted_consumer)
            log.info("consumer_updated", stream=STREAM, consumer=CONSUMER)


def _consumer_differs(current: ConsumerConfig, wanted: ConsumerConfig) -> bool:
    return (
        current.ack_wait != wanted.ack_wait
        or current.max_ack_pending != wanted.max_ack_pending
        or current.filter_subject != wanted.filter_subject
        or current.max_deliver not in (wanted.max_deliver, None)
    )


async def consumer_missing(js: JetStreamContext) -> bool:
    """Whether the durable consumer `dispatcher` (or its stream) is gone, e.g. deleted by
    hand; False when it exists or when the server cannot say (NATS away)."""
    try:
        await js.consumer_info(STREAM, CONSUMER)
    except NotFoundError:
        return True
    except Exception:  # noqa: BLE001 - not an answer about the consumer
        return False
    return False


async def subscribe_dispatcher(js: JetStreamContext) -> JetStreamContext.PullSubscription:
    """Bind to the shared durable pull consumer (creating stream and consumer if needed)."""
    await ensure_stream(js)
    return await js.pull_subscribe_bind(durable=CONSUMER, stream=STREAM)


def msg_id(job_id: int, attempt: int, generation: int = 0) -> str:
    """The `Nats-Msg-Id` for publishing a job: JetStream drops a doubled publish of it."""
    return f"job-{job_id}-a{attempt}-g{generation}"


async def publish_job(js: JetStreamContext, job_id: int, *, dedupe_id: str | None = None) -> None:
    """Publish a job id on `jobs.new` and wait for the stream to store it."""
    headers = {"Nats-Msg-Id": dedupe_id} if dedupe_id else None
    await js.publish(SUBJECT_NEW, str(job_id).encode(), headers=headers, timeout=5)
