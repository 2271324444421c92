"""`rlfleet up`: the whole scheduler on one machine.

Embedded PostgreSQL and NATS (JetStream) keep their data in a state directory, the
migrations are applied, and the poller, the dispatcher and the requeue manager run in this
one process; with `--web-port` the dashboard runs in a child process of its own
(`WebProcess`), so that no flood of its connections can take the daemons' file
descriptors, whose limit `up` raises to what the system allows (`raise_open_files_limit`).
With `--local-vm` the machine registers itself as a VM (local transport): its real
`nvidia-smi` when there is one, else a simulated one reporting `--gpus N` GPUs, so a
CPU-only machine can run real (CPU) training jobs through the scheduler.

The state directory remembers the ports (`up.json`), so running `up` again reuses the
data and, when the ports are still free, the same URLs.

Nobody but the user who runs `up` reaches the services (docs/invariants.md, invariant 7): the state
directory
is private (0700; 0710 with the PostgreSQL system user's group when run as root, so that
user alone can pass through to its data), Postgres asks every client for a generated
password (SCRAM), NATS for a generated token. The secrets live in files of mode 0600 in
the state directory (`postgres.password`, `nats.token`) and `env`, a file to `source`
that sets RLFLEET_DATABASE_URL, RLFLEET_NATS_URL and RLFLEET_NATS_TOKEN; `up` prints its
path, never a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler import migrate, sim_gpu
from scheduler.db import Database
from scheduler.embedded import (
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedServiceError,
    write_private,
)
from scheduler.errors import BadInput, ServiceUnavailable
from scheduler.fleet import VMSpec, add_vm
from scheduler.logging import get_logger
from scheduler.models import DEFAULT_ENTRYPOINT
from scheduler.redact import redact_url
from scheduler.settings import Settings
from scheduler.statedir import (
    ENV_FILE,
    NATS_TOKEN_FILE,
    PG_PASSWORD_FILE,
    StateDir,
    default_state_dir,  # noqa: F401 - where the commands have always found it
)
from scheduler.upfind import read_env_file  # noqa: F401 - where the tests have always found it

log = get_logger("up")


@dataclass
class UpOptions:
    """What `rlfleet up` was asked to do."""

    state_dir: Path
    local_vm: bool = False
    gpus: int | None = None
    vm_name: str = "local"
    entrypoint: str = DEFAULT_ENTRYPOINT
    metrics_port: int = 0
    web_port: int = 0
    """Serve the dashboard on 127.0.0.1:web_port; 0: not at all."""


def kill_leftover_servers(state: StateDir) -> None:
    """Stop servers a previous `up` left running (it was SIGKILLed): they hold the data."""
    for service, pid in state.read().get("server_pids", {}).items():
        if not isinstance(pid, int) or pid <= 0:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "postgres" not in cmdline and "nats-server" not in cmdline:
            continue  # the pid was reused by something else
        if str(state.path) not in cmdline:
            continue
        log.warning("killing_leftover_server", service=service, pid=pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.1)


def write_sim_nvidia_smi(bin_dir: Path, *, gpus: int, vm: str) -> Path:
    """Write the simulated nvidia-smi of the local VM into `bin_dir`; returns its path."""
    config = sim_gpu.make_config(vm, gpus, gpu_name="Simulated GPU (CPU)", memory_mb=16384)
    return sim_gpu.install(bin_dir, bin_dir / "sim-gpus.json", config)


def prepare_local_gpus(options: UpOptions) -> str:
    """Make `nvidia-smi` on this process's PATH report the local VM's GPUs; say which."""
    real = shutil.which("nvidia-smi")
    if real and not str(real).startswith(str(options.state_dir)):
        if options.gpus is not None:
            log.info("real_nvidia_smi_used", path=real, ignored_gpus=options.gpus)
        return f"real nvidia-smi ({real})"
    if options.gpus is None:
        raise BadInput("no nvidia-smi on this machine: pass --gpus N to simulate N GPUs")
    bin_dir = options.state_dir / "bin"
    # The state dir in the identity: two `up`s on one machine never see each other's jobs.
    identity = f"{options.vm_name}@{options.state_dir}"
    write_sim_nvidia_smi(bin_dir, gpus=options.gpus, vm=identity)
    # The local transport's shells, the jobs they launch and the simulated nvidia-smi all
    # inherit this environment: that is how a job's CUDA_VISIBLE_DEVICES shows as used.
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ[sim_gpu.VM_ENV] = identity
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    return f"simulated nvidia-smi, {options.gpus} GPU(s), jobs run on the CPU"


async def register_local_vm(db: Database, name: str, entrypoint: str) -> bool:
    """Register this machine as VM `name` (local transport); False if it already is."""
    from sqlalchemy import select, update

    from scheduler.models import VM

    async with db.transaction() as session:
        existing = await session.scalar(select(VM).where(VM.name == name))
        if existing is not None:
            if existing.transport != "local":
                raise BadInput(f"a VM named {name!r} exists and is not local: pass --vm-name")
            # The venv may have moved since the last run: keep python current.
            await session.execute(
                update(VM)
                .where(VM.id == existing.id)
                .values(python=sys.executable, entrypoint=entrypoint)
            )
            return False
        await add_vm(
            session,
            VMSpec(
                name=name,
                host="localhost",
                transport="local",
                python=sys.executable,
                entrypoint=entrypoint,
            ),
        )
        return True


@dataclass
class Services:
    """The embedded Postgres and NATS of one state directory."""

    postgres: EmbeddedPostgres
    nats: EmbeddedNats

    @property
    def settings(self) -> Settings:
        """Settings pointing at the embedded servers, with their credentials."""
        return Settings(
            database_url=self.postgres.url(), nats_url=self.nats.url, nats_token=self.nats.token
        )

    def stop(self) -> None:
        """Stop both servers (NATS first: nothing should publish to a stopped database)."""
        with contextlib.suppress(Exception):
            self.nats.stop()
        with contextlib.suppress(Exception):
            self.postgres.stop()


def start_services(state: StateDir) -> Services:
    """Start Postgres and NATS on the remembered (or new free) ports, migrated to head."""
    kill_leftover_servers(state)
    postgres = EmbeddedPostgres(
        state.path / "postgres",
        port=state.pick_port("postgres"),
        password=state.secret(PG_PASSWORD_FILE),
    )
    nats = EmbeddedNats(
        state.path / "nats", port=state.pick_port("nats"), token=state.secret(NATS_TOKEN_FILE)
    )
    services = Services(postgres, nats)
    try:
        postgres.start(timeout=60)
        nats.start()
        # Remember the servers at once: an `up` killed from now on leaves them findable.
        state.write(
            {
                **state.read(),
                "ports": {"postgres": postgres.port, "nats": nats.port},
                "server_pids": {
                    "postgres": postgres._proc.pid if postgres._proc else None,
                    "nats": nats._proc.pid if nats._proc else None,
                },
            }
        )
        migrate.upgrade(postgres.url())
    except BaseException:
        services.stop()
        raise
    return services


DaemonMain = Callable[[Settings, asyncio.Event, asyncio.Event], Awaitable[None]]


def daemon_entries() -> dict[str, DaemonMain]:
    """The three daemons' entries, each `run(settings, stop, ready)`."""
    from scheduler import dispatcher, gpu_poller, requeue

    return {"poller": gpu_poller.run, "dispatcher": dispatcher.run, "requeue": requeue.run}


async def run_daemons(settings: Settings, stop: asyncio.Event, ready: asyncio.Event) -> None:
    """Run the three daemons until `stop`; if one crashes, stop the others and re-raise."""
    entries = daemon_entries()
    readies = {name: asyncio.Event() for name in entries}
    tasks: dict[str, asyncio.Task[None]] = {
        name: asyncio.ensure_future(main(settings, stop, readies[name]))
        for name, main in entries.items()
    }
    for name, task in tasks.items():
        task.set_name(f"up:{name}")

    async def all_ready() -> None:
        await asyncio.gather(*(r.wait() for r in readies.values()))
        ready.set()

    watcher = asyncio.create_task(all_ready())
    try:
        done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                log.error("daemon_crashed", daemon=task.get_name(), error=str(task.exception()))
                stop.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        watcher.cancel()
        stop.set()
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), watcher, return_exceptions=True)


def write_env_file(state: StateDir, settings: Settings) -> Path:
    """Write `STATE/env` (mode 0600): `export` lines a shell can `source`."""
    values = {
        "RLFLEET_DATABASE_URL": settings.database_url,
        "RLFLEET_NATS_URL": settings.nats_url,
        "RLFLEET_NATS_TOKEN": settings.nats_token or "",
    }
    lines = [
        f"# rlfleet up ({state.path}): `source` this file to use its services.",
        "# It holds their credentials: keep it private (mode 0600).",
        *(f"export {key}={shlex.quote(value)}" for key, value in values.items()),
    ]
    write_private(state.env_file, "\n".join(lines) + "\n")
    return state.env_file


def announce(
    options: UpOptions,
    settings: Settings,
    gpu_note: str | None,
    web_token_where: str | None = None,
) -> None:
    """Print what the user needs: the env file to source for the other commands, and how
    to stop. Never a secret: the URLs are shown redacted."""
    env_file = options.state_dir / ENV_FILE
    lines = [
        f"rlfleet is up (state in {options.state_dir})",
        f"  Postgres: {redact_url(settings.database_url)} (password: SCRAM, "
        f"in {options.state_dir / PG_PASSWORD_FILE})",
        f"  NATS:     {settings.nats_url} (token in {options.state_dir / NATS_TOKEN_FILE})",
    ]
    if gpu_note is not None:
        lines.append(f"  local VM: {options.vm_name} ({gpu_note})")
    if options.metrics_port:
        lines.append(f"  metrics:  http://127.0.0.1:{options.metrics_port}/metrics")
    if options.web_port:
        # Where the token is, never its value.
        lines.append(
            f"  web:      http://127.0.0.1:{options.web_port}/ (actions need the token in "
            f"{web_token_where or options.state_dir / 'web.token'})"
        )
    lines += [
        "In another shell (the file sets RLFLEET_DATABASE_URL, RLFLEET_NATS_URL and "
        "RLFLEET_NATS_TOKEN; only you can read it):",
        f"  source {shlex.quote(str(env_file))}",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def raise_open_files_limit() -> int:
    """Raise this process's open-files limit (soft) to what the system allows it (hard):
    the daemons' SSH sessions, database pools and the local VM's jobs share it. Returns the
    limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("open_files_limit_kept", limit=soft, error=str(exc))
        return soft
    log.info("open_files_limit_raised", previous=soft, limit=target)
    return target


class WebProcess:
    """The dashboard of `up --web-port`, served by `rlfleet web` in a child process: a flood
    of connections then costs that process's file descriptors and event loop, never the
    daemons'. It reads its token as `up` does (`RLFLEET_WEB_TOKEN`, else STATE_DIR/web.token)
    and reaches the services with `up`'s settings, handed over in its environment (which
    only this user can read). It is stopped with `up` (and dies with it, even killed), and
    started again, a little later each time, if it ends by itself."""

    STOP_GRACE_S = 10.0
    START_TIMEOUT_S = 60.0

    def __init__(self, settings: Settings, state_dir: Path, port: int) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.port = port

    def command(self) -> list[str]:
        """The child's command line: the same `rlfleet web` a user runs, on loopback."""
        return [
            sys.executable, "-m", "scheduler.cli", "web", "--host", "127.0.0.1",
            "--port", str(self.port), "--state-dir", str(self.state_dir),
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RLFLEET_DATABASE_URL=self.settings.database_url,
            RLFLEET_NATS_URL=self.settings.nats_url,
            RLFLEET_NATS_TOKEN=self.settings.nats_token or "",
        )
        env.setdefault("RLFLEET_LOG_LEVEL", "INFO")
        return env

    async def run(self, stop: asyncio.Event, ready: asyncio.Event) -> None:
        """Serve until `stop`. Raises `OSError` if the first start fails (the port is
        taken, say): `up` then stops, as it would for any service it cannot start."""
        delay = 1.0
        while not stop.is_set():
            proc = await asyncio.create_subprocess_exec(
                *self.command(),
                env=self.environment(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                preexec_fn=_die_with_parent,
                # Ctrl-C in the terminal reaches `up`, which stops this process itself.
                start_new_session=True,
            )
            try:
                started = await self._started(proc)
                if not started and not ready.is_set():
                    code = await proc.wait()
                    raise OSError(f"the dashboard did not start on port {self.port} (exit {code})")
                if started:
                    log.info("web_process_started", pid=proc.pid, port=self.port)
                    ready.set()
                    delay = 1.0
                    drain = asyncio.create_task(_drain(proc.stdout))
                    ended = asyncio.create_task(proc.wait())
                    stopper = asyncio.create_task(stop.wait())
                    await asyncio.wait({ended, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    stopper.cancel()
                    drain.cancel()
            finally:
                await self._stop(proc)
            if stop.is_set():
                break
            log.warning("web_process_ended", code=proc.returncode, restart_in_s=delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 30.0)

    async def _started(self, proc: asyncio.subprocess.Process) -> bool:
        """Whether the child says it serves (its first line) before it ends or times out."""
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.START_TIMEOUT_S)
        except TimeoutError:
            return False
        return line.startswith(b"rlfleet web:")

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _drain(stream: asyncio.StreamReader | None) -> None:
    """Read and drop what the child prints after its first line (nothing, normally)."""
    while stream is not None and await stream.read(4096):
        pass


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (even killed), so a dashboard
    never outlives its `up` (Linux; elsewhere `up` stopping it is all there is)."""
    import ctypes

    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_up(options: UpOptions) -> None:
    """Start everything, serve until SIGINT/SIGTERM, then stop everything."""
    options.state_dir = options.state_dir.expanduser().resolve()
    raise_open_files_limit()
    state = StateDir(options.state_dir)
    state.lock()
    services: Services | None = None
    # Outside the event loop (starting, stopping) SIGTERM interrupts like Ctrl-C, so the
    # servers started so far are stopped rather than orphaned; inside it, serve() handles it.
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        gpu_note = prepare_local_gpus(options) if options.local_vm else None
        services = start_services(state)
        settings = services.settings
        if options.local_vm:
            asyncio.run(_register(settings, options.vm_name, options.entrypoint))
        write_env_file(state, settings)
        _record_started(state, services, options)
        _serve(options, state, settings, gpu_note)
    except (OSError, EmbeddedServiceError) as exc:
        raise ServiceUnavailable(f"cannot start the embedded services: {exc}") from exc
    finally:
        _shut_down(state, services, previous_sigterm)


def _record_started(state: StateDir, services: Services, options: UpOptions) -> None:
    """Write this process and the services' addresses to the state file (not ready yet)."""
    state.write(
        {
            **state.read(),
            "pid": os.getpid(),
            # Without the password: the credentials are in the env file only.
            "database_url": services.postgres.url(with_password=False),
            "nats_url": services.settings.nats_url,
            "env_file": str(state.env_file),
            "local_vm": options.vm_name if options.local_vm else None,
            "ready": False,
        }
    )


def _serve(options: UpOptions, state: StateDir, settings: Settings, gpu_note: str | None) -> None:
    """Run the daemons (and the dashboard with `--web-port`) until a signal stops them;
    once all are ready, mark the state file ready and announce it."""
    from scheduler.daemon import serve

    ready = asyncio.Event()
    web_where = None
    if options.web_port:
        from scheduler.web.server import load_token

        # Made (or checked) here, so a bad token stops `up` before anything runs; the
        # dashboard's process reads it the same way.
        web_where = load_token(options.state_dir)[1]

    async def main(stop: asyncio.Event) -> None:
        daemons_ready, web_ready = asyncio.Event(), asyncio.Event()

        async def mark_ready() -> None:
            await daemons_ready.wait()
            if web_where is not None:
                await web_ready.wait()
            ready.set()
            state.write({**state.read(), "ready": True})
            announce(options, settings, gpu_note, web_where)

        marker = asyncio.create_task(mark_ready())
        tasks = [asyncio.ensure_future(run_daemons(settings, stop, daemons_ready))]
        if web_where is not None:
            web = WebProcess(settings, options.state_dir, options.web_port)
            tasks.append(asyncio.ensure_future(web.run(stop, web_ready)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            stop.set()
            marker.cancel()

    asyncio.run(
        serve(
            "up",
            main,
            ready=ready,
            metrics_port=options.metrics_port,
            database_url=settings.database_url,
        )
    )


def _shut_down(state: StateDir, services: Services | None, previous_sigterm: Any) -> None:
    """Stop the services started (if any), clear the state file's pid and unlock it."""
    # A second Ctrl-C or SIGTERM must not cut the shutdown short (it is bounded anyway).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if services is not None:
            print("rlfleet up: stopping", file=sys.stderr, flush=True)
            services.stop()
            data = state.read()
            data.update(pid=None, ready=False, server_pids={})
            state.write(data)
        state.unlock()
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        signal.signal(signal.SIGINT, signal.default_int_handler)


async def _register(settings: Settings, name: str, entrypoint: str) -> None:
    db = Database(settings.database_url, pool_size=1)
    try:
        if await register_local_vm(db, name, entrypoint):
            log.info("local_vm_registered", vm=name)
    finally:
        await db.dispose()
