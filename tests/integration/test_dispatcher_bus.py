"""The RLFLEET_JOBS stream and the shared `dispatcher` consumer, on a real nats-server."""

from __future__ import annotations

import nats as nats_client
from nats.js.api import RetentionPolicy

from scheduler import bus
from scheduler.embedded import EmbeddedNats


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
