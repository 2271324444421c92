"""deploy/: the systemd units verify, the daemons speak systemd's notify protocol and stop
cleanly on SIGTERM, the NATS config parses, and the VM bootstrap script prepares a VM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.embedded import EmbeddedNats, nats_server_binary
from scheduler.transport import make_transport
from tests.requires import find_program, require_program
from tests.workloads.support import RLFLEET

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SERVICES = ["rlfleet-poller.service", "rlfleet-requeue.service", "rlfleet-dispatcher@.service"]


def unit_settings(path: Path) -> dict[str, list[str]]:
    """`Key=value` lines of a unit file (keys may repeat, so values are lists)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@pytest.mark.parametrize("unit", SERVICES)
def test_each_daemon_unit_is_a_notify_service_with_a_watchdog(unit: str) -> None:
    settings = unit_settings(DEPLOY / unit)
    assert settings["Type"] == ["notify"]
    assert settings["Restart"] == ["on-failure"]
    assert int(settings["WatchdogSec"][0]) > 0
    assert settings["EnvironmentFile"] == ["/etc/rlfleet/rlfleet.env"]
    assert settings["KillSignal"] == ["SIGTERM"]
    assert settings["ExecStart"][0].startswith("/opt/rlfleet/.venv/bin/rlfleet ")


def _installed_copy(dest: Path, units: list[str]) -> Path:
    """The units as installed here: ExecStart pointing at this checkout's rlfleet."""
    for unit in units:
        text = (DEPLOY / unit).read_text().replace("/opt/rlfleet/.venv/bin/", f"{RLFLEET.parent}/")
        (dest / unit).write_text(text)
    return dest


def _verify(analyze: str, directory: Path, units: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [analyze, "verify", "--man=no", *(f"./{u}" for u in units)],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def systemd_analyze() -> str:
    """systemd-analyze's path; missing, the test is skipped, or fails under CI."""
    return require_program(find_program("systemd-analyze"), "systemd-analyze", "systemd")


def test_units_pass_systemd_analyze_verify(systemd_analyze: str, tmp_path: Path) -> None:
    # Given the units as they would be installed (the template as instance 1)
    _installed_copy(tmp_path, [*SERVICES, "rlfleet.target"])
    units = [
        "rlfleet-poller.service",
        "rlfleet-requeue.service",
        "rlfleet-dispatcher@1.service",
        "rlfleet.target",
    ]
    # When systemd checks them
    result = _verify(systemd_analyze, tmp_path, units)
    # Then it finds nothing to say: no error, and no warning about any of our units
    complaints = [line for line in result.stderr.splitlines() if "rlfleet" in line]
    assert result.returncode == 0, result.stderr
    assert complaints == []


def test_verify_catches_a_broken_unit(systemd_analyze: str, tmp_path: Path) -> None:
    # The check above can fail: a misspelt key in the same unit is reported.
    _installed_copy(tmp_path, ["rlfleet-poller.service"])
    unit = tmp_path / "rlfleet-poller.service"
    unit.write_text(unit.read_text().replace("WatchdogSec=", "WatchdogSecs="))
    result = _verify(systemd_analyze, tmp_path, ["rlfleet-poller.service"])
    assert "WatchdogSecs" in result.stderr


def test_nats_server_config_is_valid() -> None:
    result = subprocess.run(
        [nats_server_binary(), "-c", str(DEPLOY / "nats-server.conf"), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "RLFLEET_NATS_PASSWORD": "from-the-environment"},
    )
    assert result.returncode == 0, result.stderr
    text = (DEPLOY / "nats-server.conf").read_text()
    assert "jetstream" in text
    # Every client must log in, with a password the file does not hold
    assert re.search(r"^authorization \{", text, re.MULTILINE)
    assert "password: $RLFLEET_NATS_PASSWORD" in text


def test_example_environment_file_names_the_settings_the_daemons_read() -> None:
    text = (DEPLOY / "rlfleet.env.example").read_text()
    for name in ("RLFLEET_DATABASE_URL", "RLFLEET_NATS_URL", "RLFLEET_METRICS_PORT"):
        assert re.search(rf"^{name}=", text, re.MULTILINE), name


# --- the daemons and systemd's notify protocol ----------------------------------------------


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET."""
    directory = tempfile.mkdtemp(prefix="sdn", dir="/tmp")  # short: AF_UNIX paths are limited
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield sock, path
    sock.close()
    shutil.rmtree(directory, ignore_errors=True)


def _messages(sock: socket.socket, until: str, timeout: float) -> list[str]:
    """Datagrams received until one contains `until` (or the timeout)."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in got[-1]:
            break
    return got


@pytest.mark.slow
@pytest.mark.parametrize("daemon", ["poller", "dispatcher", "requeue"])
def test_daemon_sends_ready_and_watchdog_then_stops_cleanly_on_sigterm(
    daemon: str,
    database_url: str,
    nats: EmbeddedNats,
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    # Given a daemon started by "systemd": NOTIFY_SOCKET set, WatchdogSec=0.4s
    env = {
        **os.environ,
        "RLFLEET_DATABASE_URL": database_url,
        "RLFLEET_NATS_URL": nats.url,
        "NOTIFY_SOCKET": path,
        "WATCHDOG_USEC": "400000",
    }
    proc = subprocess.Popen(
        [str(RLFLEET), daemon], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        # Then it says READY=1 once connected, and keeps petting the watchdog
        ready = _messages(sock, "READY=1", timeout=90)
        assert any("READY=1" in m for m in ready), (ready, proc.poll())
        pings = _messages(sock, "WATCHDOG=1", timeout=5)
        assert any("WATCHDOG=1" in m for m in pings), pings
        # When systemd stops it
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Then it exits 0 after telling systemd it is stopping, without a traceback
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert b"Traceback" not in stderr
    rest = _messages(sock, "STOPPING=1", timeout=2)
    assert any("STOPPING=1" in m for m in rest), rest


# --- the VM bootstrap script ------------------------------------------------------------


async def test_bootstrap_script_prepares_a_vm_and_prints_its_host_key(sim_fleet) -> None:  # type: ignore[no-untyped-def]
    # Given a VM with two GPUs, whose host public key sits where the script is told
    fleet = await sim_fleet(1, gpus_per_vm=2)
    vm = fleet[0]
    public = vm.host_key.export_public_key("openssh").decode().split()
    (vm.home / "host_key.pub").write_text(" ".join(public) + "\n")
    script = (DEPLOY / "bootstrap-vm.sh").read_text()
    transport = make_transport()
    args = (
        f"--venv rlfleet-venv --no-install --host-key host_key.pub "
        f"--hostname 127.0.0.1 --port {vm.port}"
    )
    try:
        # When the script is piped to it over SSH (without the long pip install)
        result = await transport.run(vm.target(), f"bash -s -- {args}", timeout=120, input=script)
        # Then the environment exists, both GPUs were seen, and the known_hosts line it
        # prints is exactly the one the control host needs
        assert result.exit_status == 0, result.stderr
        assert (vm.home / "rlfleet-venv" / "bin" / "python").exists()
        assert "2 GPU(s)" in result.stdout
        # And every job's environment file exists, readable by the VM's user only
        vm_env = vm.home / ".rlfleet" / "env"
        assert vm_env.stat().st_mode & 0o777 == 0o600
        assert "HF_TOKEN" in vm_env.read_text()
        printed = [
            line.removeprefix("known_hosts: ")
            for line in result.stdout.splitlines()
            if line.startswith("known_hosts: ")
        ]
        expected = vm.known_hosts_path.read_text().split()[:3]
        assert [p.split() for p in printed] == [expected]

        # When the GPU driver is broken, the script says so and fails
        vm.fail_nvidia_smi("driver")
        broken = await transport.run(vm.target(), f"bash -s -- {args}", timeout=120, input=script)
        assert broken.exit_status == 1
        assert "reusing the environment" in broken.stdout
        assert "nvidia-smi failed: NVIDIA-SMI has failed" in broken.stderr
    finally:
        await transport.close()


def test_bootstrap_script_rejects_an_unknown_option() -> None:
    result = subprocess.run(
        ["bash", str(DEPLOY / "bootstrap-vm.sh"), "--frobnicate"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "unknown option: --frobnicate" in result.stderr
