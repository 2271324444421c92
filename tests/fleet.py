"""A test fleet of real SSH servers: each "VM" is an in-process asyncssh server on 127.0.0.1.

Every VM has its own HOME under a temp dir, its own ed25519 host key (with a known_hosts
file the client verifies against) and accepts the fleet's client key. Commands run in a
real `/bin/sh` with `HOME=<vm home>`, `PATH=<vm bin>:$PATH`, `RLFLEET_SIM_VM=<name>` and
`RLFLEET_SIM_FLEET=<token of this fleet>` (names repeat across fleets; the token does not).
The GPU is the one thing simulated: `<vm bin>/nvidia-smi` reports the VM's GPUs in the
real csv formats and shows a GPU as used by every live process of this VM whose
environment names it in `CUDA_VISIBLE_DEVICES` (it scans /proc/*/environ).

    fleet = await sim_fleet(2, gpus_per_vm=2)     # the pytest fixture
    vm_ids = await fleet.register(db)             # rows in `vms`, keys and known_hosts set
    await fleet[0].stop(kill_processes=True)      # a crash; `await fleet[0].start()` again
    fleet[1].fail_nvidia_smi("driver")            # rc 9, as when the driver is gone
    vm = await fleet.add_vm(models=[("T4", 16384, 1), ("H100", 81920, 3)])  # mixed models
    vm.reorder_gpus(reversed(vm.gpu_uuids))       # nvidia-smi renumbers them

A VM made with `silenceable=True` sits behind a TCP relay that can go silent: `silence()`
turns it into a network black hole (TCP connections, old and new, are accepted and held
open, nothing comes back, bytes wait) while its processes run on; `unsilence()` lets the
waiting bytes through, as when a partition heals.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncssh

from scheduler import sim_gpu
from scheduler.db import Database
from scheduler.fleet import VMSpec, add_vm
from scheduler.sim_gpu import FAIL_MODES
from scheduler.transport import VMTarget

DEFAULT_GPU_NAME = "NVIDIA A100-SXM4-80GB"
DEFAULT_GPU_MEMORY_MB = 81920
PROCESS_MEMORY_MB = 1024
FAKE_TRAIN = Path(__file__).resolve().parent / "workloads" / "fake_train.py"


def sim_processes(vm_name: str, fleet_token: str) -> list[int]:
    """Pids of live processes started on the VM `vm_name` of the fleet `fleet_token`."""
    needles = {f"RLFLEET_SIM_VM={vm_name}".encode(), f"RLFLEET_SIM_FLEET={fleet_token}".encode()}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needles <= set(f.read().split(b"\0")):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


class ForeignProcess:
    """A process not started by rlfleet that holds a GPU of a simulated VM."""

    def __init__(self, proc: subprocess.Popen[bytes], gpu_index: int) -> None:
        self.proc = proc
        self.gpu_index = gpu_index

    @property
    def pid(self) -> int:
        """Its pid, as nvidia-smi reports it."""
        return self.proc.pid

    def stop(self) -> None:
        """Kill it and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


class _Gate:
    """A TCP relay in front of a VM's SSH server that can stop forwarding (a black hole)."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.port = 0
        self.upstream_port = 0
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.WriteTransport] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, upstream_port: int) -> None:
        """Listen on `port` (a free one the first time) and relay to `upstream_port`."""
        self.upstream_port = upstream_port
        self._server = await asyncio.start_server(
            self._accepted, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop every relayed connection at once (a crash)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for transport in list(self._transports):
            transport.abort()
        self._transports.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._transports.add(writer.transport)
        try:
            await self.open.wait()  # silent: the connection is accepted, nothing answers
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            self._transports.add(up_writer.transport)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            writer.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.open.wait()  # silent: the bytes wait, as in a black hole
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.transport.abort()
            self._transports.discard(writer.transport)


class _Server(asyncssh.SSHServer):
    def __init__(self, vm: SimVM) -> None:
        self.vm = vm

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.vm._conns.add(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self.vm._conns = {c for c in self.vm._conns if not c.is_closed()}

    def begin_auth(self, username: str) -> bool:
        return True  # always require a key

    def public_key_auth_supported(self) -> bool:
        return True


class SimVM:
    """One simulated VM: an SSH server on 127.0.0.1:`port` with a HOME and simulated GPUs."""

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        client_key: Path,
        authorized: asyncssh.SSHAuthorizedKeys,
        fleet_token: str,
        gpus: int = 1,
        gpu_name: str = DEFAULT_GPU_NAME,
        memory_mb: int = DEFAULT_GPU_MEMORY_MB,
        models: Sequence[tuple[str, int, int]] | None = None,
        silenceable: bool = False,
    ) -> None:
        self.name = name
        self._gate = _Gate() if silenceable else None
        self._ssh_port = 0
        self.fleet_token = fleet_token
        self.root = root
        self.home = root / "home"
        self.bin_dir = root / "bin"
        self.client_key_path = client_key
        self.known_hosts_path = root / "known_hosts"
        self.port = 0
        self._authorized = authorized
        self._server: asyncssh.SSHAcceptor | None = None
        self._conns: set[asyncssh.SSHServerConnection] = set()
        self._shells: set[asyncio.subprocess.Process] = set()
        self._foreign: list[ForeignProcess] = []
        self.home.mkdir(parents=True)
        self.bin_dir.mkdir()
        # Jobs start with a clean environment: a test's run record reaches them the way an
        # operator's settings do, through the VM's ~/.rlfleet/env.
        if os.environ.get("RLFLEET_FAKE_RECORD"):
            self.write_vm_env({"RLFLEET_FAKE_RECORD": os.environ["RLFLEET_FAKE_RECORD"]})
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.host_key_path = root / "ssh_host_ed25519_key"
        self.host_key.write_private_key(str(self.host_key_path))
        self._config = sim_gpu.make_config(
            name,
            gpus,
            gpu_name=gpu_name,
            memory_mb=memory_mb,
            fleet=fleet_token,
            process_mb=PROCESS_MEMORY_MB,
            models=models,
        )
        sim_gpu.install(self.bin_dir, self.root / "sim.json", self._config)

    @property
    def running(self) -> bool:
        """Whether the SSH server listens."""
        return self._server is not None

    @property
    def gpu_uuids(self) -> list[str]:
        """The UUIDs nvidia-smi reports, by index."""
        return [g["uuid"] for g in self._config["gpus"]]

    @property
    def cuda_uuids(self) -> list[str]:
        """The UUIDs in CUDA's default (fastest first) order."""
        return [g["uuid"] for g in sim_gpu.cuda_order(self._config["gpus"])]

    def reorder_gpus(self, uuids: Iterable[str]) -> None:
        """Renumber nvidia-smi's indices: `uuids[i]` becomes index i; a GPU left out is
        gone from nvidia-smi (a removed or lost card)."""
        sim_gpu.reorder(self._config, list(uuids))
        sim_gpu.write_config(self.root / "sim.json", self._config)

    def devices_of(self, pid: int) -> list[str]:
        """The UUIDs of the GPUs the process `pid` uses, read as CUDA reads its
        `CUDA_VISIBLE_DEVICES` (nothing if it is gone)."""
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return []
        env = dict(v.decode(errors="replace").split("=", 1) for v in raw.split(b"\0") if b"=" in v)
        return sim_gpu.devices_of(self._config["gpus"], env)

    def silent(self) -> bool:
        """Whether the VM is silenced (see `silence`)."""
        return self._gate is not None and not self._gate.open.is_set()

    def silence(self) -> None:
        """Stop answering, as a hung VM or a network black hole does: TCP connections are
        accepted and kept, nothing comes back; the VM's processes run on."""
        if self._gate is None:
            raise RuntimeError(f"{self.name} was not made silenceable")
        self._gate.open.clear()

    def unsilence(self) -> None:
        """Answer again: what waited is delivered, as when a partition heals."""
        if self._gate is None:
            raise RuntimeError(f"{self.name} was not made silenceable")
        self._gate.open.set()

    async def start(self) -> None:
        """Listen (again) on the VM's port, with the same host key."""
        if self._server is not None:
            return
        self._server = await asyncssh.create_server(
            lambda: _Server(self),
            "127.0.0.1",
            self._ssh_port if self._gate is not None else self.port,
            server_host_keys=[self.host_key],
            authorized_client_keys=self._authorized,
            process_factory=self._handle,
            encoding=None,
            reuse_address=True,
            keepalive_interval=0,
        )
        if self._gate is not None:
            self._ssh_port = self._server.get_port()
            await self._gate.start(self._ssh_port)
        if not self.port:
            self.port = self._gate.port if self._gate is not None else self._server.get_port()
            public = self.host_key.export_public_key("openssh").decode().strip()
            self.known_hosts_path.write_text(f"[127.0.0.1]:{self.port} {public}\n")

    async def stop(self, *, kill_processes: bool = False) -> None:
        """Close the server and drop its connections; `kill_processes` simulates a crash."""
        if self._gate is not None:
            await self._gate.stop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()
        for shell in list(self._shells):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
        if kill_processes:
            self.kill_processes()

    def kill_processes(self) -> None:
        """SIGKILL every process started on this VM, as a power loss would."""
        for pid in sim_processes(self.name, self.fleet_token):
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for foreign in self._foreign:
            foreign.stop()

    def write_vm_env(self, values: dict[str, str]) -> Path:
        """Write the VM's `~/.rlfleet/env` (mode 0600), as deploy/bootstrap-vm.sh creates it."""
        path = self.home / ".rlfleet" / "env"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
        return path

    def processes(self) -> list[int]:
        """Pids of live processes started on this VM."""
        return sim_processes(self.name, self.fleet_token)

    def fail_nvidia_smi(self, mode: str | None) -> None:
        """Make nvidia-smi fail like a real one (see `FAIL_MODES`), or None to heal it."""
        if mode is not None and mode not in FAIL_MODES:
            raise ValueError(f"unknown nvidia-smi failure mode {mode!r}; use one of {FAIL_MODES}")
        self._config["fail"] = mode
        sim_gpu.write_config(self.root / "sim.json", self._config)

    def set_busy_power(self, gpu_index: int, watts: float | None) -> None:
        """What GPU `gpu_index` draws while in use (a hung collective keeps a GPU 100 %
        busy at low power); None: the default."""
        for gpu in self._config["gpus"]:
            if gpu["index"] == gpu_index:
                if watts is None:
                    gpu.pop("busy_power", None)
                else:
                    gpu["busy_power"] = watts
        sim_gpu.write_config(self.root / "sim.json", self._config)

    def set_gpu_health(self, index: int, **health: object) -> None:
        """Make GPU `index` report health trouble as a real one does (`sim_gpu.set_health`:
        ecc, retired_pending, remapped_pending, fault, unsupported, vanished); None for a
        setting takes it back."""
        sim_gpu.set_health(self._config, index, **health)
        sim_gpu.write_config(self.root / "sim.json", self._config)

    def add_foreign_process(self, gpu_index: int) -> ForeignProcess:
        """Start a process rlfleet did not launch that holds GPU `gpu_index`."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "RLFLEET_SIM_VM": self.name,
            "RLFLEET_SIM_FLEET": self.fleet_token,
            "CUDA_VISIBLE_DEVICES": str(gpu_index),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        proc = subprocess.Popen(["sleep", "3600"], env=env, start_new_session=True)
        foreign = ForeignProcess(proc, gpu_index)
        self._foreign.append(foreign)
        return foreign

    def spec(self, *, entrypoint: str | None = None, python: str | None = None) -> VMSpec:
        """The VM as `rlfleet vm add` would register it, with its key and known_hosts."""
        return VMSpec(
            name=self.name,
            host="127.0.0.1",
            port=self.port,
            user=getpass.getuser(),
            ssh_key_path=str(self.client_key_path),
            known_hosts=str(self.known_hosts_path),
            verify_host_key=True,
            transport="ssh",
            python=python or sys.executable,
            entrypoint=entrypoint or str(FAKE_TRAIN),
        )

    def target(self, vm_id: int = 0) -> VMTarget:
        """A `VMTarget` for this VM without a database row (for transport tests)."""
        spec = self.spec()
        return VMTarget(id=vm_id, **spec.__dict__)

    async def _handle(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        env = dict(os.environ)
        env.update(
            HOME=str(self.home),
            PATH=f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            RLFLEET_SIM_VM=self.name,
            RLFLEET_SIM_FLEET=self.fleet_token,
        )
        for var in ("CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST"):
            env.pop(var, None)
        shell = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            process.command or "exit 0",
            cwd=self.home,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._shells.add(shell)
        feeder = asyncio.create_task(_feed(process.stdin, shell.stdin))
        try:
            assert shell.stdout is not None and shell.stderr is not None
            await asyncio.gather(
                _pump(shell.stdout, process.stdout), _pump(shell.stderr, process.stderr)
            )
            rc = await shell.wait()
        except (OSError, asyncssh.Error, asyncio.CancelledError):
            # The client went away: like sshd, end the session's own processes.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
            await shell.wait()
            return
        finally:
            feeder.cancel()
            self._shells.discard(shell)
        with contextlib.suppress(OSError, asyncssh.Error):
            if rc < 0:
                process.exit_with_signal(signal.Signals(-rc).name.removeprefix("SIG"))
            else:
                process.exit(rc)


async def _pump(reader: asyncio.StreamReader, writer: asyncssh.SSHWriter[bytes]) -> None:
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()  # SSH flow control, as sshd: a slow client is not buffered for


async def _feed(reader: asyncssh.SSHReader[bytes], writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    with contextlib.suppress(OSError, asyncssh.Error, ConnectionError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        writer.close()


class SimFleet:
    """A set of `SimVM`s sharing one client key; index it or iterate it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.client_key_path = root / "id_ed25519"
        key = asyncssh.generate_private_key("ssh-ed25519")
        key.write_private_key(str(self.client_key_path))
        self.client_key_path.chmod(0o600)
        self._authorized = asyncssh.import_authorized_keys(
            key.export_public_key("openssh").decode()
        )
        self.vms: list[SimVM] = []
        # VM names repeat across fleets (and across test runs sharing this machine), so
        # processes are told apart by this token too, in RLFLEET_SIM_FLEET.
        self.token = uuid.uuid4().hex[:12]

    async def add_vm(
        self,
        name: str | None = None,
        *,
        gpus: int = 1,
        gpu_name: str = DEFAULT_GPU_NAME,
        memory_mb: int = DEFAULT_GPU_MEMORY_MB,
        models: Sequence[tuple[str, int, int]] | None = None,
        silenceable: bool = False,
    ) -> SimVM:
        """Create and start one more VM; `models` (`(name, memory_mb, speed)` per GPU, in
        nvidia-smi's index order) makes its GPUs differ, and sets their number; `silenceable`
        puts it behind a relay that can go silent."""
        name = name or f"vm{len(self.vms)}"
        vm = SimVM(
            self.root / name,
            name,
            client_key=self.client_key_path,
            authorized=self._authorized,
            fleet_token=self.token,
            gpus=gpus,
            gpu_name=gpu_name,
            memory_mb=memory_mb,
            models=models,
            silenceable=silenceable,
        )
        await vm.start()
        self.vms.append(vm)
        return vm

    async def register(
        self, db: Database, *, entrypoint: str | None = None, python: str | None = None
    ) -> dict[str, int]:
        """Add every VM to the `vms` table; returns their ids by name."""
        ids = {}
        async with db.transaction() as session:
            for vm in self.vms:
                row = await add_vm(session, vm.spec(entrypoint=entrypoint, python=python))
                ids[vm.name] = row.id
        return ids

    def by_name(self, name: str) -> SimVM:
        """The VM called `name`."""
        return next(vm for vm in self.vms if vm.name == name)

    def __getitem__(self, index: int) -> SimVM:
        return self.vms[index]

    def __iter__(self) -> Iterator[SimVM]:
        return iter(self.vms)

    def __len__(self) -> int:
        return len(self.vms)

    async def close(self) -> None:
        """Stop every VM and kill every process started on it."""
        for vm in self.vms:
            await vm.stop(kill_processes=True)


async def start_fleet(root: Path, n_vms: int, *, gpus_per_vm: int = 1, **gpu: object) -> SimFleet:
    """A started fleet of `n_vms` VMs named vm0, vm1, … with `gpus_per_vm` GPUs each."""
    fleet = SimFleet(root)
    for _ in range(n_vms):
        await fleet.add_vm(gpus=gpus_per_vm, **gpu)  # type: ignore[arg-type]
    return fleet
