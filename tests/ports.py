"""Free loopback ports for the servers the tests start, one range per pytest-xdist worker.

`scheduler.embedded.free_port` asks the kernel for an ephemeral port (bind to 0), closes it,
and the server binds it a moment later. Under parallel workers that moment is a race: the
kernel hands the same ephemeral range to every process, to the other workers' bind(0) and
to every outgoing connection, so another worker can take the port first and the server
fails to start. Here each worker draws from its own range below the ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, 32768 and up on Linux): no other worker and no
outgoing connection is ever given one of its ports. A port is handed out only when it can
be bound now (not listened on, not in TIME_WAIT), and never twice by one process.

tests/conftest.py installs it as `scheduler.embedded.free_port` for the whole session, so
that EmbeddedPostgres, EmbeddedNats, the OpenSSH VMs and every test that imports
`free_port` from there use it.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading

BASE = 12000
SPAN = 600
SLOTS = (32768 - BASE) // SPAN  # ranges that stay below the ephemeral range


def worker_slot() -> int:
    """This process's range: 0 without xdist, 1 + n for worker gw<n>."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return 1 + int(worker[2:]) % (SLOTS - 1)
    return 0


_lock = threading.Lock()
_given: set[int] = set()
_start = BASE + worker_slot() * SPAN
# A random first port: two test sessions run at once on one machine (two developers) start
# apart in the same range; the bind check below keeps them apart after that.
_cursor = itertools.cycle(
    [_start + (i + random.randrange(SPAN)) % SPAN for i in range(SPAN)]
)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of this worker's range that nothing uses right now."""
    with _lock:
        for _ in range(SPAN):
            port = next(_cursor)
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
        # Every port handed out once: take them again, those free now.
        _given.clear()
        for _ in range(SPAN):
            port = next(_cursor)
            if _bindable(host, port):
                _given.add(port)
                return port
    raise OSError(f"no free port in {_start}..{_start + SPAN - 1}")
