"""The transport and the poller against OpenSSH's real `sshd`, the server users run.

sshd runs as one VM of tests/sshd.py's fleet: a non-daemon child on a free loopback port with
its own host key, config and authorized_keys in a temp dir, its sessions with a HOME of their
own there, so attempts never mix with the user's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import asyncssh
import pytest
from sqlalchemy import select

from scheduler import sim_gpu
from scheduler.db import Database
from scheduler.fleet import VMSpec, add_vm
from scheduler.gpu_poller import GpuPoller
from scheduler.leftovers import LeftoverSweep
from scheduler.models import GPU, VM
from scheduler.sim_gpu import gpu_uuid
from scheduler.transport import HostKeyMismatch, SSHTransport, TransportError
from tests.sshd import SshdFleet, SshdVM
from tests.workloads.support import alive, job_attempt_dir, job_row, launch_on

RealSshd = SshdVM
"""One VM behind OpenSSH's sshd (tests/sshd.py); tests/integration/test_silent.py uses it."""


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[SshdVM]:
    """sshd on 127.0.0.1, with a simulated nvidia-smi (2 GPUs) first on the session PATH."""
    fleet = SshdFleet(tmp_path / "sshd-fleet")
    try:
        yield fleet.add_vm("real", gpus=2)
    finally:
        fleet.close()


@pytest.mark.slow
async def test_commands_over_real_sshd(sshd: RealSshd) -> None:
    transport = SSHTransport()
    try:
        # Given a transport verifying sshd's host key, when commands run over one connection
        hello = await transport.run(sshd.target, "echo hello; echo err >&2; exit 4", timeout=10)
        piped = await transport.run(sshd.target, "wc -c", timeout=10, input="12345")
        # Then output, errors, exit status and stdin all come through
        assert (hello.exit_status, hello.stdout, hello.stderr) == (4, "hello\n", "err\n")
        assert piped.stdout.strip() == "5"
        assert transport.open_connections == 1
        # And a command past its timeout fails without waiting for the command, which the
        # VM's own `timeout` ends: it ignores SIGTERM, so only the SIGKILL 7 s in ends it,
        # before the `touch` (left alone it would end after 30 s, having made the marker)
        marker = sshd.root / "late"
        command = f"trap '' TERM; sleep 30; touch {marker}"
        with pytest.raises(TransportError, match="timed out"):
            await transport.run(sshd.target, command, timeout=0.5)
        assert _running(marker), "the transport waited for the command to end"
        deadline = time.monotonic() + 30
        while _running(marker):
            assert time.monotonic() < deadline, "the remote command outlived its timeout"
            await asyncio.sleep(0.1)
        assert not marker.exists(), "the remote command outlived its timeout"
    finally:
        await transport.close()


def _running(text: Path) -> bool:
    """Whether some process on this host has `text` in its command line."""
    needle = str(text).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if needle in (proc / "cmdline").read_bytes():
                    return True
            except OSError:
                pass  # it ended while we looked
    return False


async def test_real_sshd_with_an_unknown_host_key_is_refused(sshd: RealSshd) -> None:
    # Given a known_hosts file that holds some other key for sshd's address
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key("openssh").decode()
    wrong = sshd.root / "wrong_known_hosts"
    wrong.write_text(f"[127.0.0.1]:{sshd.target.port} {other}")
    transport = SSHTransport()
    try:
        # Then the connection is refused
        with pytest.raises(HostKeyMismatch):
            await transport.run(
                dataclasses.replace(sshd.target, known_hosts=str(wrong)), "true", timeout=10
            )
    finally:
        await transport.close()


async def test_the_poller_polls_a_vm_behind_real_sshd(sshd: RealSshd, db: Database) -> None:
    # Given the sshd host registered as a VM
    target = sshd.target
    async with db.transaction() as session:
        vm = await add_vm(
            session,
            VMSpec(
                name="real",
                host=target.host,
                port=target.port,
                user=target.user,
                ssh_key_path=target.ssh_key_path,
                known_hosts=target.known_hosts,
            ),
        )
        vm_id = vm.id
    transport = SSHTransport()
    try:
        # When the poller sweeps
        stats = await GpuPoller(db, transport).sweep()
    finally:
        await transport.close()
    # Then the VM is healthy with its two GPUs recorded
    assert stats.reachable == 1
    async with db.transaction() as session:
        row = await session.get(VM, vm_id)
        assert row is not None
        assert (row.status, row.available_gpus, row.last_error) == ("healthy", 2, None)
        gpus = (await session.execute(GPU.__table__.select().where(GPU.vm_id == vm_id))).all()
    assert sorted(g.uuid for g in gpus) == sorted(gpu_uuid("real", i) for i in range(2))


@pytest.mark.slow
async def test_gpu_health_behind_real_sshd_stops_the_job_on_a_gpu_requiring_reset(
    sshd: RealSshd, db: Database
) -> None:
    """Given a job on GPU 0 of a VM behind OpenSSH's sshd, when GPU 0 reports
    [GPU requires reset] and GPU 1 vanishes from the listing, then each GPU (not the VM)
    is unhealthy with its reason, the job failed as gpu_failed with no retry used, and
    the kill sweep stops its process over the same sshd."""
    target = sshd.target
    async with db.transaction() as session:
        vm = await add_vm(
            session,
            VMSpec(
                name="real",
                host=target.host,
                port=target.port,
                user=target.user,
                ssh_key_path=target.ssh_key_path,
                known_hosts=target.known_hosts,
            ),
        )
        vm_id = vm.id
    transport = SSHTransport()
    try:
        poller = GpuPoller(db, transport)
        await poller.sweep()
        job_id = await launch_on(
            db, transport, dataclasses.replace(target, id=vm_id), 0, "--fake_seconds", "60"
        )
        await poller.sweep()
        config = json.loads((sshd.root / "sim.json").read_text())
        sim_gpu.set_health(config, 0, fault="[GPU requires reset]")
        sim_gpu.set_health(config, 1, vanished=True)
        sim_gpu.write_config(sshd.root / "sim.json", config)
        await poller.sweep()
        job = await job_row(db, job_id)
        assert (job.status, job.failure_reason, job.retry_count) == ("failed", "gpu_failed", 0)
        pid = int((await job_attempt_dir(db, job_id, sshd.home) / "pid").read_text())
        assert alive(pid)
        report = await LeftoverSweep(db, transport, grace_s=1.0, actor="test").sweep()
        assert report.killed == [job_id]
        assert not alive(pid)
    finally:
        await transport.close()
    async with db.transaction() as session:
        row = await session.get(VM, vm_id)
        assert row is not None and (row.status, row.available_gpus) == ("healthy", 0)
        gpus = (await session.scalars(select(GPU).where(GPU.vm_id == vm_id))).all()
    reasons = {g.uuid: g.health_reason for g in gpus}
    assert reasons == {
        gpu_uuid("real", 0): "requires reset: nvidia-smi prints [GPU requires reset]",
        gpu_uuid("real", 1): "lost: no longer listed by nvidia-smi",
    }
