"""The RLFLEET_JOBS stream and the shared `dispatcher` consumer, on a real nats-server."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats as nats_client
import pytest
from nats.js.api import RetentionPolicy

from scheduler import bus
from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.settings import Settings
from tests.workloads.support import new_job, publish, running_dispatcher, wait_status


async def test_stream_and_consumer_are_created_and_brought_up_to_date(
    nats: EmbeddedNats,
) -> None:
    """Given a consumer created by an older version with another ack wait, ensure_stream
    updates it in place; the stream is a work queue that captures plain publishes, and
    two subscribers of the durable consumer share its messages."""
    nc = await nats_client.connect(nats.url)
    js = nc.jetstream()
    await js.add_stream(bus.stream_config())
    old = bus.consumer_config()
    old.ack_wait = 5.0
    old.max_ack_pending = 10
    await js.add_consumer(bus.STREAM, old)

    await bus.ensure_stream(js)
    await bus.ensure_stream(js)  # idempotent

    info = await js.consumer_info(bus.STREAM, bus.CONSUMER)
    assert (info.config.ack_wait, info.config.max_ack_pending) == (
        bus.ACK_WAIT_S,
        bus.consumer_config().max_ack_pending,
    )
    stream = await js.stream_info(bus.STREAM)
    assert stream.config.retention == RetentionPolicy.WORK_QUEUE
    assert stream.config.subjects == [bus.SUBJECT_NEW]

    for i in range(4):
        await nc.publish(bus.SUBJECT_NEW, str(i + 1).encode())
    await nc.flush()
    first = await bus.subscribe_dispatcher(js)
    second = await bus.subscribe_dispatcher(js)
    got = [m for m in await first.fetch(2, timeout=2)] + [
        m for m in await second.fetch(2, timeout=2)
    ]
    assert sorted(m.data for m in got) == [b"1", b"2", b"3", b"4"]
    for m in got:
        await m.ack_sync()
    assert (await js.stream_info(bus.STREAM)).state.messages == 0
    await nc.close()


@pytest.mark.slow
async def test_a_daemon_connection_backs_off_while_nats_is_down_and_resets_after(
    tmp_path: Path,
) -> None:
    """Given a daemon's connection, when nats-server goes away, then each failed reconnect
    makes the next wait longer (up to the cap) instead of knocking at a fixed rate; when
    the server is back on its port the connection works again and the wait is reset."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    settings = Settings(database_url="postgresql+psycopg://unused/x", nats_url=server.url)
    backoff = bus.ReconnectBackoff(base_s=0.05, max_s=0.4)
    nc = await bus.connect_until(
        settings, name="test-daemon", stop=asyncio.Event(), backoff=backoff
    )
    assert nc is not None
    try:
        server.stop()
        started = time.monotonic()
        while backoff.failures < 5 and time.monotonic() - started < 20:
            await asyncio.sleep(0.02)
        assert backoff.failures >= 5
        assert 0.3 <= nc.options["reconnect_time_wait"] <= 0.5  # the cap, ± jitter
        # At a fixed 0.05 s there would be some 30 attempts in 1.5 s; backing off, ~5.
        await asyncio.sleep(max(0.0, 1.5 - (time.monotonic() - started)))
        assert backoff.failures <= 10, backoff.failures

        server.start()
        while not nc.is_connected and time.monotonic() - started < 30:
            await asyncio.sleep(0.05)
        assert nc.is_connected
        assert (backoff.failures, nc.options["reconnect_time_wait"]) == (0, 0.05)
        got = await nc.subscribe("ping")
        await nc.publish("ping", b"pong")
        assert (await got.next_msg(timeout=5)).data == b"pong"
    finally:
        await nc.close()
        server.stop()


async def test_a_daemon_started_while_nats_is_down_stops_when_told(tmp_path: Path) -> None:
    """Given no NATS server, a daemon's connect keeps trying (backing off) and does not
    return; when the daemon is told to stop it returns None at once instead of hanging
    until systemd kills it. Once the server runs, the connect succeeds."""
    server = EmbeddedNats(tmp_path / "nats")  # its port is chosen, nothing listens yet
    settings = Settings(database_url="postgresql+psycopg://unused/x", nats_url=server.url)
    stop = asyncio.Event()
    backoff = bus.ReconnectBackoff(base_s=0.05, max_s=0.2)
    connecting = asyncio.create_task(
        bus.connect_until(settings, name="test-daemon", stop=stop, backoff=backoff)
    )
    started = time.monotonic()
    while backoff.failures < 3 and time.monotonic() - started < 20:
        await asyncio.sleep(0.02)
    assert backoff.failures >= 3 and not connecting.done()
    stop.set()
    assert await asyncio.wait_for(connecting, 5) is None

    server.start()
    try:
        nc = await asyncio.wait_for(
            bus.connect_until(settings, name="test-daemon", stop=asyncio.Event()), 20
        )
        assert nc is not None and nc.is_connected
        await nc.close()
    finally:
        server.stop()


async def test_a_dispatcher_whose_consumer_was_deleted_recreates_it_and_goes_on(
    db: Database, nats: EmbeddedNats
) -> None:
    """Given a running dispatcher, when its durable consumer is deleted by hand, then it
    creates the consumer again itself and dispatches the jobs published afterwards (here:
    no VM fits, so the dispatcher parks them as pending)."""
    nc = await nats_client.connect(nats.url)
    js = nc.jetstream()
    try:
        async with running_dispatcher(db, nats.url):
            before = await new_job(db, 1)
            await publish(nc, before)
            await wait_status(db, before, "pending")

            await js.delete_consumer(bus.STREAM, bus.CONSUMER)
            after = await new_job(db, 1)
            await publish(nc, after)
            job = await wait_status(db, after, "pending", timeout=30)
            # The dispatcher looked at it: the reason is its verdict on an empty fleet.
            assert (job.status_reason or "").startswith("no VM has 1 GPU"), job.status_reason
            info = await js.consumer_info(bus.STREAM, bus.CONSUMER)
            assert info.config.durable_name == bus.CONSUMER
    finally:
        await nc.close()
