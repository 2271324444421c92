"""The poll's reads of a job's files never wait on a FIFO (issue 29, "still open"): a job
that swaps a FIFO in after the poll's `[ -f ]` test, with no writer or with one that holds
it open and writes nothing, does not hold the read, so its VM's polls never time out."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.poll import poll_command
from scheduler.remote.layout import Attempt, new_token
from scheduler.remote.output import NONBLOCK_LINES, head_bytes, tail_bytes
from scheduler.transport import LocalTransport, TransportError, VMTarget

INSTALLATION = "8ecee215-6897-4b04-b858-5f093b6805ac"

READS = {
    "head": head_bytes(24, '"$f"'),
    "tail": tail_bytes(4096, '"$f"'),
}


def run_read(
    read: str, path: Path, timeout: float = 5.0, *, nonblock: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """`read` of `path` in sh; `nonblock`: after `NONBLOCK_LINES` (else as on a VM whose dd
    has no `iflag=nonblock`)."""
    script = "\n".join([*(NONBLOCK_LINES if nonblock else []), f"f={path}", read])
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=timeout)


@pytest.fixture
def held_fifo(tmp_path: Path) -> Iterator[Path]:
    """A FIFO that a writer holds open without writing (a job's process)."""
    fifo = tmp_path / "held"
    os.mkfifo(fifo)
    opened = threading.Event()

    def hold() -> None:
        fd = os.open(fifo, os.O_RDWR)  # never waits: it is its own reader
        opened.set()
        time.sleep(8)
        os.close(fd)

    threading.Thread(target=hold, daemon=True).start()
    assert opened.wait(5)
    yield fifo


@pytest.mark.parametrize("how", sorted(READS))
def test_a_read_of_a_fifo_without_writer_returns_at_once(tmp_path: Path, how: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    done = run_read(READS[how], fifo)
    assert done.stdout == b"" and time.monotonic() - started < 4


@pytest.mark.parametrize("how", sorted(READS))
def test_a_read_of_a_fifo_held_open_returns_at_once(held_fifo: Path, how: str) -> None:
    started = time.monotonic()
    done = run_read(READS[how], held_fifo)
    assert done.stdout == b"" and time.monotonic() - started < 4


@pytest.mark.parametrize("size", [0, 5, 4095, 4096, 4097, 10_000, 3 * 4096 + 17])
def test_the_reads_of_a_regular_file_are_what_head_and_tail_print(
    tmp_path: Path, size: int
) -> None:
    data = bytes(i % 251 for i in range(size))
    path = tmp_path / "file"
    path.write_bytes(data)
    for nonblock in (True, False):
        assert run_read(READS["head"], path, nonblock=nonblock).stdout == data[:24]
        assert run_read(READS["tail"], path, nonblock=nonblock).stdout == data[-4096:]


@pytest.mark.slow
async def test_a_job_swapping_fifos_in_and_out_never_times_out_its_vms_polls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an exited attempt whose pid, exit_code, train.log and progress.json a job
    keeps swapping between a regular file and a FIFO (each swap right after the other, so
    that a poll's `[ -f ]` test and its read see different files), when the VM is polled
    40 times with a 3 s timeout, then no poll times out."""
    monkeypatch.setenv("HOME", str(tmp_path))
    run = Attempt(INSTALLATION, 7, 1, new_token())
    directory = tmp_path / run.relative
    directory.mkdir(parents=True)
    contents = {"pid": b"999999999\n", "exit_code": b"0\n", "train.log": b"x\n" * 100,
                "progress.json": b'{"step": 1}'}  # fmt: skip
    for name, data in contents.items():
        (directory / name).write_bytes(data)
    stop = threading.Event()

    def swap() -> None:
        spare = tmp_path / "spare"
        while not stop.is_set():
            for name, data in contents.items():
                with contextlib.suppress(OSError):
                    os.mkfifo(spare)
                    os.replace(spare, directory / name)
                    spare.write_bytes(data)
                    os.replace(spare, directory / name)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    target = VMTarget(id=1, name="local", host="localhost", transport="local")
    timeouts = 0
    try:
        for _ in range(40):
            try:
                await LocalTransport().run(target, poll_command([run]), timeout=3)
            except TransportError:
                timeouts += 1
    finally:
        stop.set()
        swapper.join(5)
    assert timeouts == 0
