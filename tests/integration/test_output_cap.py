"""Every command's output is bounded (issue 29, "High"): the transport keeps the last
`OUTPUT_LIMIT` bytes of each of a command's stdout and stderr and counts the rest as it
arrives, locally and over SSH (the in-process fleet and OpenSSH's sshd), on an exec
channel and in the persistent session. The reader's peak memory stays small while a
command prints hundreds of megabytes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from scheduler.output_cap import OUTPUT_LIMIT, Tail
from scheduler.poll import parse_poll, poll_command, poll_output_limit
from scheduler.remote.layout import Attempt, new_token
from scheduler.transport import CommandResult, LocalTransport, SSHTransport, Transport, VMTarget
from tests.sshd import SshdFleet

INSTALLATION = "8ecee215-6897-4b04-b858-5f093b6805ac"
HUGE = 256 * 1024 * 1024
"""Bytes the command prints on each of stdout and stderr: unbounded, the reader would hold
them (and a decoded copy) several times over."""
GROWTH_LIMIT = 96 * 1024 * 1024
"""Most this process's peak memory may grow by while it reads `2 * HUGE` bytes."""
FAKE = "__rlfleet_end_0123456789abcdef"
"""Shaped like the persistent session's end marker, with a token that is not the request's."""
COMMAND = (
    f"head -c {HUGE} /dev/zero; printf '\\n{FAKE} 0\\nend of out\\n';"
    f" {{ head -c {HUGE} /dev/zero; printf 'end of err\\n'; }} >&2; exit 3"
)
"""Prints `HUGE` bytes then a lookalike marker and a last line on stdout, the same on
stderr, and exits 3."""


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


async def peak_growth(run: Callable[[], Awaitable[CommandResult]]) -> tuple[CommandResult, int]:
    """`run()`'s result and how many bytes this process's peak RSS grew above its RSS
    before (`VmHWM` reset through /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kib("VmRSS")
    result = await run()
    return result, (_rss_kib("VmHWM") - before) * 1024


def check_bounded(result: CommandResult, growth: int) -> None:
    assert result.exit_status == 3
    assert result.stdout.endswith(f"\n{FAKE} 0\nend of out\n")
    assert result.stderr.endswith("\0end of err\n")
    out_total = HUGE + len(f"\n{FAKE} 0\nend of out\n")
    assert len(result.stdout) == OUTPUT_LIMIT
    assert result.stdout_dropped == out_total - OUTPUT_LIMIT
    assert result.stderr_dropped == HUGE + len("end of err\n") - OUTPUT_LIMIT
    assert growth < GROWTH_LIMIT, f"peak memory grew by {growth / 2**20:.0f} MiB"


@pytest.fixture
def sshd_vm(tmp_path: Path) -> Iterator[VMTarget]:
    fleet = SshdFleet(tmp_path / "sshd-fleet")
    try:
        yield fleet.add_vm("capped").target
    finally:
        fleet.close()


async def _run_capped(transport: Transport, target: VMTarget, persistent: bool) -> None:
    try:
        result, growth = await peak_growth(
            lambda: transport.run(target, COMMAND, timeout=120, persistent=persistent)
        )
        check_bounded(result, growth)
        print(f"{target.name} persistent={persistent}: peak grew {growth / 2**20:.1f} MiB")
        # The session (or connection) still serves the next command, whole.
        small = await transport.run(target, "echo next", timeout=30, persistent=persistent)
        assert (small.stdout, small.stdout_dropped) == ("next\n", 0)
    finally:
        await transport.close()


@pytest.mark.slow
async def test_local_command_output_is_capped_to_its_tail() -> None:
    target = VMTarget(id=1, name="local", host="localhost", transport="local")
    await _run_capped(LocalTransport(), target, persistent=False)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["exec", "session"])
async def test_ssh_command_output_is_capped_to_its_tail(sim_fleet, persistent: bool) -> None:
    fleet = await sim_fleet(1)
    await _run_capped(SSHTransport(), fleet[0].target(), persistent)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["exec", "session"])
async def test_sshd_command_output_is_capped_to_its_tail(sshd_vm, persistent: bool) -> None:
    await _run_capped(SSHTransport(), sshd_vm, persistent)


async def test_a_caller_may_ask_for_more_or_less_output(sim_fleet) -> None:
    fleet = await sim_fleet(1)
    transport = SSHTransport()
    local = VMTarget(id=1, name="local", host="localhost", transport="local")
    command = "head -c 3000 /dev/zero | tr '\\0' x; echo; echo done"
    try:
        for t, target, persistent in [
            (transport, fleet[0].target(), False),
            (transport, fleet[0].target(), True),
            (LocalTransport(), local, False),
        ]:
            big = await t.run(target, command, timeout=30, persistent=persistent, max_output=4000)
            small = await t.run(target, command, timeout=30, persistent=persistent, max_output=10)
            assert (len(big.stdout), big.stdout_dropped) == (3006, 0)
            assert (small.stdout, small.stdout_dropped) == ("xxxxx\ndone\n"[-10:], 2996)
    finally:
        await transport.close()


async def test_session_finds_its_marker_after_an_overlapping_lookalike(sim_fleet) -> None:
    """A lookalike marker whose last byte would be the first of the real one (no newline
    after the fake exit status) does not hide the real one."""
    fleet = await sim_fleet(1)
    transport = SSHTransport()
    try:
        result = await transport.run(
            fleet[0].target(), f"printf 'a\\n{FAKE} 7'", timeout=10, persistent=True
        )
        assert (result.exit_status, result.stdout) == (0, f"a\n{FAKE} 7")
    finally:
        await transport.close()


def test_tail_keeps_the_last_bytes_and_counts_the_rest() -> None:
    tail = Tail(4)
    for piece in [b"ab", b"cdef", b"g", b"", b"hijklmnop", b"q"]:
        tail.add(piece)
    assert (tail.value(), tail.dropped, tail.total) == (b"nopq", 13, 17)
    empty = Tail(0)
    empty.add(b"xyz")
    assert (empty.value(), empty.dropped) == (b"", 3)
    assert Tail(8).value() == b"" and Tail(8).dropped == 0
    short = Tail(8)
    short.add(b"abc")
    assert (short.value(), short.dropped) == (b"abc", 0)


async def test_a_poll_of_many_exited_attempts_with_full_log_tails_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given 24 exited attempts on a VM, each log's last 4 KB all newlines (each line
    printed with its prefix: ~75 KB of poll answer per attempt, past the transport's
    default cap in all), when the poll runs with the cap the poller asks for, then every
    attempt's exit is read: nothing of the answer is dropped."""
    monkeypatch.setenv("HOME", str(tmp_path))
    attempts = [Attempt(INSTALLATION, job, 1, new_token()) for job in range(1, 25)]
    for run in attempts:
        directory = tmp_path / run.relative
        directory.mkdir(parents=True)
        (directory / "pid").write_text("999999999\n")  # past any pid_max: not running
        (directory / "exit_code").write_text("0\n")
        (directory / "train.log").write_bytes(b"\n" * 8192)
    target = VMTarget(id=1, name="local", host="localhost", transport="local")
    limit = poll_output_limit(len(attempts))
    result = await LocalTransport().run(
        target, poll_command(attempts), timeout=60, max_output=limit
    )
    assert result.stdout_dropped == 0 and len(result.stdout) > OUTPUT_LIMIT
    jobs = parse_poll(result.stdout).jobs
    assert {key: (s.state, s.exit_code) for key, s in jobs.items()} == {
        (run.job_id, 1): ("exited", 0) for run in attempts
    }


@pytest.mark.parametrize("where", ["local", "ssh"])
async def test_a_streamed_command_with_much_stderr_does_not_stall(sim_fleet, where: str) -> None:
    """`stream` (job pull) reads the command's stderr while its stdout streams: a command
    that writes 4 MB of errors before its output ends at once, its stderr's end kept."""
    transport = LocalTransport() if where == "local" else SSHTransport()
    if where == "local":
        target = VMTarget(id=1, name="local", host="localhost", transport="local")
    else:
        target = (await sim_fleet(1))[0].target()
    got: list[bytes] = []
    command = "head -c 4000000 /dev/zero | tr '\\0' e >&2; echo out; echo last >&2"
    try:
        rc, err = await transport.stream(target, command, got.append, timeout=20)
    finally:
        await transport.close()
    assert (rc, b"".join(got)) == (0, b"out\n")
    assert err.endswith("eeelast\n") and len(err) <= 2000
