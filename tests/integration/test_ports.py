"""The ports the tests' servers listen on (tests/ports.py): one range per xdist worker, below
the kernel's ephemeral range, so that parallel workers never race for a port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from scheduler.embedded import EmbeddedNats, EmbeddedPostgres
from tests import ports


def ephemeral_low() -> int:
    """The first port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def own_range() -> range:
    start = ports.BASE + ports.worker_slot() * ports.SPAN
    return range(start, start + ports.SPAN)


def test_each_worker_has_its_own_range_below_the_ephemeral_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken: set[int] = set()
    for worker in ["", *(f"gw{n}" for n in range(ports.SLOTS - 1))]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        start = ports.BASE + ports.worker_slot() * ports.SPAN
        block = set(range(start, start + ports.SPAN))
        assert not block & taken, worker
        taken |= block
    assert max(taken) < ephemeral_low()


def test_the_servers_of_a_test_listen_on_its_workers_range(
    nats: EmbeddedNats, postgres: EmbeddedPostgres
) -> None:
    assert nats.port in own_range()
    assert postgres.port in own_range()


def test_a_port_in_use_is_never_handed_out() -> None:
    with socket.socket() as busy:
        for port in own_range():
            try:
                busy.bind(("127.0.0.1", port))
            except OSError:
                continue
            busy.listen()
            break
        held = busy.getsockname()[1]
        given = {ports.free_port() for _ in range(ports.SPAN - 1)}
    assert held not in given
    assert given <= set(own_range())
