"""A test fleet of OpenSSH's real `sshd`, the server users run: each "VM" is one sshd.

Each VM is a non-daemon `sshd -D` on a free loopback port, with its own host key, config,
authorized_keys (the fleet's client key), HOME and simulated nvidia-smi config in a
directory of its own. Its sessions get, through `SetEnv`, `HOME=<vm home>`,
`PATH=<vm bin>:/usr/local/bin:/usr/bin:/bin`, `RLFLEET_SIM_VM=<name>` and
`RLFLEET_SIM_FLEET=<token of this fleet>`, and nothing else of the test's environment (as
on a real VM, settings reach jobs through `~/.rlfleet/env`). The GPU is the one thing
simulated (scheduler/sim_gpu.py). `make test` installs openssh-server when it is missing.

    fleet = start_sshd_fleet(tmp_path / "vms", 2, gpus_per_vm=1)
    vm_ids = await fleet.register(db, entrypoint="training.train_grpo")
    fleet[0].crash()        # its sshd and every process of its sessions are SIGKILLed
    fleet[0].start()        # up again: same port, same host key
    fleet.close()           # every VM stopped, every process started on it killed

`SshdFleet(root, JobUserAccounts())` makes VMs whose sessions log in as a fresh non-root
account S (their HOME is S's) beside a fresh job user J, with the sudo rule that
deploy/bootstrap-vm.sh --job-user installs; `root` must be searchable by both
(`searchable_root`). Creating the accounts needs root (the tests skip otherwise) and sudo
(`make sshd` installs it); `JobUserAccounts.close` deletes them and the rule.

A VM's processes are told apart by the `RLFLEET_SIM_VM`/`RLFLEET_SIM_FLEET` pair in their
environment (tests/fleet.py `sim_processes`), so a crash only ever touches processes that
were started on that VM, never this process and never pid 1.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from scheduler import sim_gpu
from scheduler.db import Database
from scheduler.embedded import free_port
from scheduler.fleet import VMSpec, add_vm
from scheduler.transport import VMTarget
from tests.fleet import FAKE_TRAIN, PROCESS_MEMORY_MB, sim_processes
from tests.requires import find_program, require_program

# Missing sshd skips the tests that use it, or fails them under CI (tests/requires.py).
SSHD = find_program("sshd", "/usr/sbin/sshd")


def _write_key(path: Path) -> asyncssh.SSHKey:
    key = asyncssh.generate_private_key("ssh-ed25519")
    path.write_bytes(key.export_private_key("openssh"))
    path.chmod(0o600)
    return key


def _safe_kill(pid: int, sig: signal.Signals) -> None:
    """Signal one process; never pid <= 1 nor this process."""
    if pid <= 1 or pid == os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


class SshdVM:
    """One VM: OpenSSH's sshd on 127.0.0.1:`port` with a HOME and simulated GPUs."""

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        sshd_path: str,
        client_key: Path,
        authorized_keys: str,
        fleet_token: str,
        gpus: int = 1,
        gpu_name: str = "NVIDIA L4",
        memory_mb: int = 23034,
        accounts: JobUserAccounts | None = None,
    ) -> None:
        self.name = name
        self.accounts = accounts
        """With accounts: sessions log in as `accounts.login` (S), whose home this VM's
        HOME is, and jobs may run as `accounts.job` (J)."""
        self.root = root
        self.fleet_token = fleet_token
        self.sshd_path = sshd_path
        self.client_key_path = client_key
        self.known_hosts_path = root / "known_hosts"
        self.bin_dir = root / "bin"
        self.bin_dir.mkdir(parents=True)
        self.home.mkdir()
        host_key = _write_key(root / "host_key")
        (root / "authorized_keys").write_text(authorized_keys)
        self._config: dict[str, Any] = sim_gpu.make_config(
            name, gpus, gpu_name=gpu_name, memory_mb=memory_mb, fleet=fleet_token,
            process_mb=PROCESS_MEMORY_MB,
        )  # fmt: skip
        sim_gpu.install(self.bin_dir, root / "sim.json", self._config)
        self.port = free_port()
        (root / "sshd_config").write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {root / 'host_key'}",
                    f"AuthorizedKeysFile {root / 'authorized_keys'}",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "PidFile none",
                    "LogLevel ERROR",
                    f"SetEnv PATH={self.bin_dir}:/usr/local/bin:/usr/bin:/bin"
                    f" RLFLEET_SIM_VM={name} RLFLEET_SIM_FLEET={fleet_token} HOME={self.home}",
                    "",
                ]
            )
        )
        public = host_key.export_public_key("openssh").decode().strip()
        self.known_hosts_path.write_text(f"[127.0.0.1]:{self.port} {public}\n")
        if accounts is not None:
            accounts.own_home(self.home)
            # S cannot run this process's python (under root's home): the system's runs
            # the simulated nvidia-smi (a script of the standard library only).
            smi = self.bin_dir / "nvidia-smi"
            smi.write_text(smi.read_text().replace(shlex.quote(sys.executable), SYSTEM_PYTHON))
            (root / "sim.json").chmod(0o644)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def home(self) -> Path:
        """$HOME of the sessions (the ~ of the VM)."""
        return self.root / "home"

    @property
    def running(self) -> bool:
        """Whether sshd runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def login(self) -> str:
        """The account its sessions log in as."""
        return self.accounts.login if self.accounts is not None else getpass.getuser()

    @property
    def target(self) -> VMTarget:
        """A `VMTarget` for this VM without a database row (for transport tests)."""
        return VMTarget(
            id=0,
            name=self.name,
            host="127.0.0.1",
            port=self.port,
            user=self.login,
            ssh_key_path=str(self.client_key_path),
            known_hosts=str(self.known_hosts_path),
        )

    @property
    def gpu_uuids(self) -> list[str]:
        """The UUIDs nvidia-smi reports, by index."""
        return [g["uuid"] for g in self._config["gpus"]]

    def start(self) -> None:
        """Start sshd (again) on the VM's port, with the same host key; returns once it
        listens."""
        if self.running:
            return
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        log = self.root / "sshd.log"
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [self.sshd_path, "-D", "-e", "-f", str(self.root / "sshd_config")],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("sshd never listened") from None
                time.sleep(0.05)

    def sshd_pids(self) -> list[int]:
        """The listening sshd and every sshd process it forked (one or two per connection)."""
        if self.proc is None:
            return []
        children: dict[int, list[int]] = {}
        names: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue  # it ended while we looked
                name, rest = stat[stat.index("(") + 1 :].rsplit(")", 1)
                names[int(entry.name)] = name
                children.setdefault(int(rest.split()[1]), []).append(int(entry.name))
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            if names.get(pid, "").startswith("sshd"):
                found.append(pid)
                todo += children.get(pid, [])
        return found

    def processes(self) -> list[int]:
        """Pids of live processes started in this VM's sessions (sshd itself aside)."""
        return sim_processes(self.name, self.fleet_token)

    def stop(self) -> None:
        """Stop sshd and drop its connections (the VM's processes run on)."""
        for pid in self.sshd_pids():
            _safe_kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
            self.proc = None

    def crash(self) -> None:
        """The VM crashes (a power loss): its sshd, every connection's sshd and every
        process started in its sessions are SIGKILLed at once; nothing else is touched."""
        for pid in self.sshd_pids():
            _safe_kill(pid, signal.SIGSTOP)  # no new session starts while we look
        self.kill_processes()
        self.stop()
        # Anything a session forked between the looks, and processes still tearing down
        # after their SIGKILL (a training process takes a moment to exit): a crash is over
        # once none is left.
        deadline = time.monotonic() + 10
        while self.processes() and time.monotonic() < deadline:
            self.kill_processes()
            time.sleep(0.05)

    def kill_processes(self) -> None:
        """SIGKILL every process started in this VM's sessions."""
        for pid in self.processes():
            _safe_kill(pid, signal.SIGKILL)

    def write_vm_env(self, values: dict[str, str]) -> Path:
        """Write the VM's `~/.rlfleet/env` (mode 0600), as deploy/bootstrap-vm.sh creates it."""
        path = self.home / ".rlfleet" / "env"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
        return path

    def set_busy_power(self, gpu_index: int, watts: float | None) -> None:
        """What GPU `gpu_index` draws while in use; None: the default."""
        for gpu in self._config["gpus"]:
            if gpu["index"] == gpu_index:
                if watts is None:
                    gpu.pop("busy_power", None)
                else:
                    gpu["busy_power"] = watts
        sim_gpu.write_config(self.root / "sim.json", self._config)

    def set_gpu_health(self, index: int, **health: object) -> None:
        """Make GPU `index` report health trouble (`sim_gpu.set_health`)."""
        sim_gpu.set_health(self._config, index, **health)
        sim_gpu.write_config(self.root / "sim.json", self._config)

    def spec(self, *, entrypoint: str | None = None, python: str | None = None) -> VMSpec:
        """The VM as `rlfleet vm add` would register it, with its key and known_hosts."""
        return VMSpec(
            name=self.name,
            host="127.0.0.1",
            port=self.port,
            user=self.login,
            ssh_key_path=str(self.client_key_path),
            known_hosts=str(self.known_hosts_path),
            verify_host_key=True,
            transport="ssh",
            python=python or sys.executable,
            entrypoint=entrypoint or str(FAKE_TRAIN),
        )


SUDO = find_program("sudo", "/usr/bin/sudo")
SYSTEM_PYTHON = "/usr/bin/python3"
"""The python of VMs whose accounts are not this process's (`JobUserAccounts`)."""
VISUDO = find_program("visudo", "/usr/sbin/visudo")
USERADD = find_program("useradd", "/usr/sbin/useradd")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, capture_output=True)


class JobUserAccounts:
    """Two fresh Unix accounts for OpenSSH VMs with a job user, as
    `deploy/bootstrap-vm.sh --job-user` sets them up: S (`login`), the account the
    scheduler logs in as, a member of J's group; J (`job`), the jobs' account, with no
    home (its jobs get `$d/job`); and the sudoers drop-in `S ALL=(J) NOPASSWD: ALL`,
    checked with `visudo -c`. Needs root (useradd); `close` kills what runs as either
    account (only they ever ran as these fresh uids), deletes both and the drop-in.

    `by_bootstrap`: only S is made, with sudo to root, for deploy/bootstrap-vm.sh
    `--job-user` to make J and its rule itself (`close` deletes what it made too)."""

    def __init__(self, *, by_bootstrap: bool = False) -> None:
        if os.geteuid() != 0:
            pytest.skip("creating the accounts of a job user needs root")
        require_program(SUDO, "sudo", "sudo")
        require_program(VISUDO, "visudo", "sudo")
        require_program(USERADD, "useradd", "passwd")
        tag = uuid.uuid4().hex[:8]
        self.login, self.job = f"rls{tag}", f"rlj{tag}"
        self.sudoers = Path(f"/etc/sudoers.d/rlfleet-test-{tag}")
        self._made: list[str] = []
        self.by_bootstrap = by_bootstrap
        try:
            # '*': no password, yet not locked (sshd without PAM refuses a locked account).
            if not by_bootstrap:
                _run("useradd", "-M", "-d", "/nonexistent", "-s", "/bin/sh", "-p", "*", "-U",
                     self.job)  # fmt: skip
            self._made.append(self.job)
            # S's shell is bash, which reads ~/.bashrc for the commands sshd runs: what a
            # job would have to change to make S's commands (`job pull`'s tar) its own.
            shell = "/bin/bash" if Path("/bin/bash").exists() else "/bin/sh"
            groups = [] if by_bootstrap else ["-G", self.job]
            _run("useradd", "-M", "-d", "/nonexistent", "-s", shell, "-p", "*", "-U",
                 *groups, self.login)  # fmt: skip
            self._made.append(self.login)
            draft = self.sudoers.with_name(f"rlfleet-test-{tag}.draft")  # sudo skips '.'
            runas = "root" if by_bootstrap else self.job
            draft.write_text(f"{self.login} ALL=({runas}) NOPASSWD: ALL\n")
            draft.chmod(0o440)
            _run("visudo", "-c", "-q", "-f", str(draft))
            draft.rename(self.sudoers)
        except BaseException:
            self.close()
            raise
        self.refresh()

    def refresh(self) -> None:
        """Read the accounts' uids and J's group (J: once it exists)."""
        import pwd

        self.login_uid = pwd.getpwnam(self.login).pw_uid
        try:
            self.job_uid = pwd.getpwnam(self.job).pw_uid
            self.job_gid = pwd.getpwnam(self.job).pw_gid
        except KeyError:
            self.job_uid = self.job_gid = -1

    def own_home(self, home: Path) -> None:
        """Make `home` S's home: S's, group J, mode 0710 (J may search it, as
        bootstrap-vm.sh sets it; nothing more); each directory above must be searchable."""
        if self.job_gid >= 0:
            os.chown(home, self.login_uid, self.job_gid)
            home.chmod(0o710)
        else:  # bootstrap-vm.sh --job-user sets its group and mode
            os.chown(home, self.login_uid, self.login_uid)
        usermod = ["usermod", "-d", str(home), self.login]
        _run(*usermod)

    def processes(self) -> list[int]:
        """Pids of live processes running as S or J."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    uid = entry.stat().st_uid
                except OSError:
                    continue
                if uid in (getattr(self, "login_uid", -1), getattr(self, "job_uid", -1)):
                    pids.append(int(entry.name))
        return pids

    def close(self) -> None:
        """Kill what runs as S or J, delete both accounts and the sudoers drop-in."""
        self.sudoers.unlink(missing_ok=True)
        Path(f"/etc/sudoers.d/rlfleet-job-user-{self.login}").unlink(missing_ok=True)
        for _ in range(3):
            for pid in self.processes():
                _safe_kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for name in reversed(self._made):
            remove = ["-r"] if self.by_bootstrap and name == self.job else []  # its /home
            subprocess.run(
                ["userdel", *remove, name], capture_output=True, stdin=subprocess.DEVNULL
            )
        self._made.clear()


def searchable_root(prefix: str) -> Path:
    """A fresh directory under /tmp that any account may search (0711), for VMs whose
    accounts are not this process's (pytest's own temp directories are 0700)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o711)
    return root


class SshdFleet:
    """A set of `SshdVM`s sharing one client key; index it or iterate it."""

    def __init__(self, root: Path, accounts: JobUserAccounts | None = None) -> None:
        self.accounts = accounts
        self.sshd_path = require_program(SSHD, "OpenSSH sshd", "openssh-server")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.client_key_path = root / "client_key"
        key = _write_key(self.client_key_path)
        self._authorized = key.export_public_key("openssh").decode()
        # VM names repeat across fleets; processes are told apart by this token too.
        self.token = uuid.uuid4().hex[:12]
        self.vms: list[SshdVM] = []

    def add_vm(self, name: str | None = None, *, gpus: int = 1, **gpu: Any) -> SshdVM:
        """Create and start one more VM."""
        name = name or f"vm{len(self.vms)}"
        vm = SshdVM(
            self.root / name,
            name,
            sshd_path=self.sshd_path,
            client_key=self.client_key_path,
            authorized_keys=self._authorized,
            fleet_token=self.token,
            gpus=gpus,
            accounts=self.accounts,
            **gpu,
        )
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

    def by_name(self, name: str) -> SshdVM:
        """The VM called `name`."""
        return next(vm for vm in self.vms if vm.name == name)

    def __getitem__(self, index: int) -> SshdVM:
        return self.vms[index]

    def __iter__(self) -> Iterator[SshdVM]:
        return iter(self.vms)

    def __len__(self) -> int:
        return len(self.vms)

    def close(self) -> None:
        """Stop every VM and kill every process started on it."""
        for vm in self.vms:
            vm.crash()


def start_sshd_fleet(root: Path, n_vms: int, *, gpus_per_vm: int = 1, **gpu: Any) -> SshdFleet:
    """A started fleet of `n_vms` sshd VMs named vm0, vm1, … with `gpus_per_vm` GPUs each."""
    fleet = SshdFleet(root)
    for _ in range(n_vms):
        fleet.add_vm(gpus=gpus_per_vm, **gpu)
    return fleet


@pytest.fixture
def sshd_fleet(tmp_path: Path) -> Iterator[Callable[..., SshdFleet]]:
    """Factory of sshd fleets (import it into a test module to use it):
    `fleet = sshd_fleet(2, gpus_per_vm=1)`; every fleet is crashed after the test, which
    kills every process started on its VMs."""
    fleets: list[SshdFleet] = []

    def make(n_vms: int = 1, *, gpus_per_vm: int = 1, **gpu: Any) -> SshdFleet:
        fleet = SshdFleet(tmp_path / f"sshd-fleet{len(fleets)}")
        fleets.append(fleet)
        for _ in range(n_vms):
            fleet.add_vm(gpus=gpus_per_vm, **gpu)
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()
