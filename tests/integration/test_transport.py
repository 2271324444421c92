"""The SSH transport against real SSH servers (the simulated fleet of tests/fleet.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import asyncssh
import pytest

from scheduler.ssh_channel import dead_connection
from scheduler.transport import (
    HostKeyMismatch,
    LocalTransport,
    SSHTransport,
    TransportError,
    VMTarget,
    make_transport,
)
from tests.workloads.support import alive, wait_file


async def test_runs_commands_in_the_vm_shell_over_one_reused_connection(sim_fleet) -> None:
    # Given one VM and a fresh transport
    fleet = await sim_fleet(1)
    vm = fleet[0]
    transport = SSHTransport()
    try:
        # When three commands run, one of them with stdin and a failing exit status
        first = await transport.run(vm.target(), 'echo "$HOME $RLFLEET_SIM_VM"', timeout=10)
        second = await transport.run(
            vm.target(), "cat; echo oops >&2; exit 3", timeout=10, input="from stdin\n"
        )
        third = await transport.run(vm.target(), "kill -KILL $$", timeout=10)
        # Then each ran in the VM's shell and environment
        assert first.ok and first.stdout.strip() == f"{vm.home} {vm.name}"
        assert (second.exit_status, second.stdout, second.stderr) == (3, "from stdin\n", "oops\n")
        assert third.exit_status == 128 + 9
        # And all of them went over a single connection
        assert transport.open_connections == 1
        assert len(vm._conns) == 1
    finally:
        await transport.close()


async def test_concurrent_first_commands_open_only_one_connection(sim_fleet) -> None:
    # Given a VM nobody is connected to yet
    fleet = await sim_fleet(1)
    transport = SSHTransport()
    try:
        # When ten commands race to be first
        results = await asyncio.gather(
            *(transport.run(fleet[0].target(), f"echo {i}", timeout=10) for i in range(10))
        )
        # Then they all ran and the per-host lock let a single connect through
        assert [r.stdout.strip() for r in results] == [str(i) for i in range(10)]
        assert len(fleet[0]._conns) == 1
    finally:
        await transport.close()


async def test_reconnects_after_the_vm_restarts(sim_fleet) -> None:
    # Given a VM with a pooled connection
    fleet = await sim_fleet(1)
    vm = fleet[0]
    transport = SSHTransport()
    try:
        assert (await transport.run(vm.target(), "true", timeout=10)).ok
        # When the VM goes down, the command fails with TransportError (no hang, no crash)
        await vm.stop()
        with pytest.raises(TransportError):
            await transport.run(vm.target(), "true", timeout=5)
        # And when it comes back on the same port, the next command reconnects by itself
        await vm.start()
        result = await transport.run(vm.target(), "echo back", timeout=10)
        assert result.stdout.strip() == "back"
    finally:
        await transport.close()


async def test_host_key_mismatch_refuses_the_connection(sim_fleet, tmp_path) -> None:
    # Given two VMs, and a target for the first that carries the second's known_hosts line
    fleet = await sim_fleet(2)
    wrong = tmp_path / "known_hosts"
    wrong_key = fleet[1].known_hosts_path.read_text().split(" ", 1)[1]
    wrong.write_text(f"[127.0.0.1]:{fleet[0].port} {wrong_key}")
    target = dataclasses.replace(fleet[0].target(), known_hosts=str(wrong))
    transport = SSHTransport()
    try:
        # When we connect, then the connection is refused before any command runs
        with pytest.raises(HostKeyMismatch, match="host key"):
            await transport.run(target, "touch ran", timeout=10)
        assert not (fleet[0].home / "ran").exists()
        # And only an explicit verify_host_key=False accepts the unknown key
        lax = dataclasses.replace(target, verify_host_key=False)
        assert (await transport.run(lax, "echo lax", timeout=10)).stdout.strip() == "lax"
    finally:
        await transport.close()


async def test_wrong_client_key_and_closed_port_are_transport_errors(sim_fleet, tmp_path) -> None:
    # Given a VM, a key it does not know and a port where nothing listens
    fleet = await sim_fleet(1)
    stranger = tmp_path / "stranger"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(stranger))
    stranger.chmod(0o600)
    unknown_key = dataclasses.replace(fleet[0].target(), ssh_key_path=str(stranger))
    await fleet[0].stop()
    closed = fleet[0].target()
    await fleet[0].start()
    transport = SSHTransport(connect_timeout=3, login_timeout=3)
    try:
        # Then both fail with a TransportError naming the VM
        with pytest.raises(TransportError, match="vm0"):
            await transport.run(unknown_key, "true", timeout=5)
        await fleet[0].stop()
        with pytest.raises(TransportError, match="cannot connect"):
            await transport.run(closed, "true", timeout=5)
    finally:
        await transport.close()


@pytest.mark.slow
async def test_a_command_past_its_timeout_fails_and_is_killed_on_the_vm(sim_fleet) -> None:
    # Given a VM
    fleet = await sim_fleet(1)
    vm = fleet[0]
    transport = SSHTransport()

    def still_running() -> bool:
        return any(b"sleep\x0037" in _cmdline(p) for p in vm.processes())

    try:
        # When a command outlives its timeout (one that ignores SIGTERM, so the VM's
        # `timeout` wrapper ends it only with SIGKILL, 7 s in)
        with pytest.raises(TransportError, match="timed out"):
            await transport.run(vm.target(), "trap '' TERM; sleep 37; touch finished", timeout=0.5)
        # Then the caller was not kept waiting for it: it still runs on the VM
        assert still_running(), "the transport waited for the command to end"
        # And the VM itself ends it too (the remote `timeout` wrapper, SIGKILL after SIGTERM)
        deadline = time.monotonic() + 30
        while still_running():
            assert time.monotonic() < deadline, "the remote command outlived its timeout"
            await asyncio.sleep(0.2)
        # And the pooled connection is still usable
        assert (await transport.run(vm.target(), "echo ok", timeout=10)).stdout == "ok\n"
    finally:
        await transport.close()


@pytest.mark.slow
async def test_global_bound_limits_concurrent_commands(sim_fleet) -> None:
    # Given two VMs and a transport allowing two commands at a time
    fleet = await sim_fleet(2)
    transport = SSHTransport(max_concurrency=2)
    try:
        await asyncio.gather(*(transport.run(vm.target(), "true", timeout=10) for vm in fleet))
        # When six half-second commands are started at once, each recording its start
        cmd = 'date +%s.%N >> "$HOME/starts"; sleep 0.5'
        targets = [fleet[i % 2].target() for i in range(6)]
        await asyncio.gather(*(transport.run(t, cmd, timeout=20) for t in targets))
        # Then they ran in three waves, never more than two at once
        starts = sorted(float(x) for vm in fleet for x in (vm.home / "starts").read_text().split())
        assert len(starts) == 6
        assert starts[2] - starts[0] >= 0.45 and starts[4] - starts[2] >= 0.45
    finally:
        await transport.close()


async def test_make_transport_routes_local_vms_to_a_subprocess(sim_fleet, tmp_path) -> None:
    # Given a router, a local VM and a simulated SSH VM
    fleet = await sim_fleet(1)
    transport = make_transport()
    local = VMTarget(id=1, name="here", host="localhost", transport="local")
    try:
        # Then the local one runs on this machine, the other in the VM's shell over SSH
        here = await transport.run(local, 'echo "${RLFLEET_SIM_VM:-none}"', timeout=10)
        there = await transport.run(fleet[0].target(), 'echo "$RLFLEET_SIM_VM"', timeout=10)
        assert here.stdout.strip() == "none"
        assert there.stdout.strip() == "vm0"
    finally:
        await transport.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


async def test_concurrent_commands_share_one_persistent_shell(sim_fleet) -> None:
    """Given ten commands sent at once to a VM with no shell open yet, they all run in
    the same remote shell: no second shell is opened and left behind on the VM."""
    fleet = await sim_fleet(1)
    # Without the VM-side timeout wrapper, `$$` in the command is the session shell's pid.
    transport = SSHTransport(remote_timeout=False)
    try:
        results = await asyncio.gather(
            *(
                transport.run(fleet[0].target(), "echo $$", timeout=10, persistent=True)
                for _ in range(10)
            )
        )
        assert len({r.stdout for r in results}) == 1, [r.stdout for r in results]
    finally:
        await transport.close()


async def test_persistent_session_runs_commands_framed_and_isolated(sim_fleet) -> None:
    # Given a VM and a transport keeping a shell open on it
    fleet = await sim_fleet(1)
    vm = fleet[0]
    transport = SSHTransport()
    try:
        # When commands run one after another in the session
        run = transport.run
        first = await run(
            vm.target(), "cd /; export X=1; echo a; echo b >&2; exit 5", timeout=10, persistent=True
        )
        second = await run(vm.target(), 'pwd; echo "${X:-unset}"', timeout=10, persistent=True)
        # Then each has its own output, errors and exit status, and none leaks its state
        assert (first.exit_status, first.stdout, first.stderr) == (5, "a\n", "b\n")
        assert second.stdout.split() == [str(vm.home), "unset"] and second.exit_status == 0
        # And a command past its timeout fails without spoiling the next one
        with pytest.raises(TransportError, match="timed out"):
            await run(vm.target(), "sleep 30", timeout=0.5, persistent=True)
        third = await run(vm.target(), "printf 'no newline'", timeout=10, persistent=True)
        assert third.stdout == "no newline"
        # And a VM restart is survived by reconnecting
        await vm.stop()
        await vm.start()
        fourth = await run(vm.target(), "echo again", timeout=10, persistent=True)
        assert fourth.stdout == "again\n"
    finally:
        await transport.close()


async def test_a_reconnect_replaces_only_the_connection_that_failed(sim_fleet) -> None:
    """Given two commands that failed on the same pooled connection, the first one's
    reconnect replaces it; the second one's finds it replaced already and reuses the new
    connection instead of closing it under the first one's command. A connection that
    only refused one more channel (MaxSessions) is not treated as dead."""
    fleet = await sim_fleet(1)
    transport = SSHTransport()
    target = fleet[0].target()
    try:
        old = await transport._connection(target)
        new = await transport._connection(target, stale=old)
        assert new is not old and old.is_closed()
        again = await transport._connection(target, stale=old)
        assert again is new and not new.is_closed()
        refused = asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, "max")
        assert not dead_connection(new, refused)
        assert dead_connection(old, refused)
        assert (await transport.run(target, "echo ok", timeout=10)).stdout == "ok\n"
    finally:
        await transport.close()


async def test_a_cancelled_local_command_leaves_no_process(tmp_path) -> None:
    """Given a command running through the local transport, when its caller is cancelled
    (a daemon stopping), then its whole process group is killed, not left running."""
    pids = tmp_path / "pids"
    target = VMTarget(id=1, name="local", host="localhost", transport="local")
    command = f"sleep 30 & echo $$ $! > {pids}; wait"
    running = asyncio.create_task(LocalTransport().run(target, command, timeout=60))
    group = [int(p) for p in (await wait_file(pids)).split()]
    assert all(alive(pid) for pid in group)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in group) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not any(alive(pid) for pid in group)


async def test_persistent_session_output_with_a_lookalike_end_marker_stays_whole(
    sim_fleet,
) -> None:
    # A command whose output holds something shaped like the session's end marker (a job
    # can write anything the poll prints) gets it back as output: only this request's
    # own marker, with its fresh token, ends the output.
    fleet = await sim_fleet(1)
    transport = SSHTransport()
    fake = "__rlfleet_end_0123456789abcdef"
    try:
        result = await transport.run(
            fleet[0].target(),
            f"printf 'a\\n{fake} 0\\nb\\n'; printf 'c\\n{fake}\\nd\\n' >&2; exit 4",
            timeout=10,
            persistent=True,
        )
        again = await transport.run(fleet[0].target(), "echo next", timeout=10, persistent=True)
    finally:
        await transport.close()
    assert result.exit_status == 4
    assert result.stdout == f"a\n{fake} 0\nb\n"
    assert result.stderr == f"c\n{fake}\nd\n"
    assert (again.exit_status, again.stdout) == (0, "next\n")
