"""The group supervisor: runs the roles of a job group that live on one VM.

Shipped to the VM as a file of the attempt directory (`supervisor.py`) and run by the
attempt's wrapper in place of the training command, so the attempt stays one process
tree with one pid, one exit code and one status line (docs/invariants.md, contract 1 and
2). Standard library only: the VM's python may not have the scheduler installed.

    python supervisor.py group.json

`group.json` (written by the launch, no secret in it) lists the roles in start order with
their argv, own variables (CUDA_VISIBLE_DEVICES with the role's slice of the attempt's
GPUs), readiness check, dependencies and whether each is primary. Each role runs in a
process group of its own, its output in `<role>.log` of the attempt directory.

A group over several VMs has one supervisor per VM, each with only that VM's roles (of a
role on several nodes, its rank on this VM, whose place is in its own variables): a
dependency on a role of another VM is waited for by its readiness check at that VM's
address (its timeout counted from when this VM starts waiting; a dependency without a
check is not waited for). A VM whose roles include no primary never ends on its own: the
scheduler kills it once the VMs with primaries have completed.

Lifecycle: before a role starts, every role it depends on must pass its readiness check
(HTTP GET → 2xx, or a TCP connect) within that check's timeout, else the supervisor stops
everything and exits `NOT_READY_EXIT` after the line `rlfleet-group: role R not ready
after Ns`. The check goes on while the group runs (a liveness check, every `live_every_s`,
by the supervisor running the role, its entry's `live`): a role that passed it and then
fails it for `live_fail_s` has stopped answering. A role that exits non-zero, a
non-primary role that exits while a primary runs, or a role that stopped answering, fails:
a role with `restart` (`restart: on-failure` in the job file) is restarted in place, with
the same argv, variables, address and port, after a backoff (`restart_backoff_s`, doubled
at each restart, at most `restart_backoff_max_s`) while the other roles run on, at most
its `max` times (after a restart it must pass its check again within the check's
timeout); any other failure, or one past `max`, stops every role and the supervisor exits
with that role's code (1 for a service that exited 0 too early, `NOT_READY_EXIT` for one
that stopped answering). Each restart is counted in `roles.json` (`restarts`, and the cause
of the latest: `restart_cause` `exited` with `restart_exit`, or `unresponsive`), which the
poller reads with every probe. When every primary role has exited 0 the others are stopped
(TERM, KILL after the grace period) and the supervisor exits 0. TERM/INT/HUP stop every
role and exit 128 + the signal.

The group's own traffic never goes through a proxy: readiness checks are made directly,
with the attempt's token (`Authorization: Bearer $RLFLEET_GROUP_TOKEN`, which the launch puts
in the supervisor's environment, never in `group.json`), and every role gets `no_proxy` /
`NO_PROXY` naming loopback and the group's addresses, added to any it had, so that a
`http_proxy` meant for downloads does not swallow calls between roles.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any

NOT_READY_EXIT = 94
"""A role a dependency waited for never passed its readiness check (retried)."""
CANNOT_START_EXIT = 64
"""A role's command cannot be started at all (not found, not executable): permanent."""
EARLY_SERVICE_EXIT = 1
"""A non-primary role exited 0 while a primary still ran: a failure of the group."""
ROLE_EXIT_MAP = {126: 1, 127: 1}
"""A role's exit codes the attempt must not pass on as they are: 126/127 from the attempt
mean the VM's python cannot run at all (the VM is marked), not a role's own failure."""
MARK = "rlfleet-group:"
ROLES_FILE = "roles.json"
"""Each role's pid, state (`waiting`, `running`, `restarting`, `exited`, `stopped`), exit
code, and restarts in place (`restarts`, `restart_cause`, `restart_exit`)."""
RESTART_CAUSES = ("exited", "unresponsive")
"""Why a role was restarted: it exited, or it stopped answering its readiness check."""
POLL_S = 0.2
TOKEN_ENV = "RLFLEET_GROUP_TOKEN"
"""The attempt's token, which a group's services may ask of every request."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")


GOES_ON, SUCCEEDS, FAILS = "goes_on", "succeeds", "fails"
"""What the exit of one unit means for what it belongs to (`unit_exit`)."""


def unit_exit(primary: bool, code: int, primaries_done: bool, *, shared: bool = True) -> str:
    """What the exit (with `code`) of one unit means: a role for its VM's group here, a
    rank for its attempt in the scheduler (`scheduler.attempts.end`, which calls this
    very function: the one rule at both levels). `primaries_done`: every primary unit,
    this one included, has exited 0. A unit that exits non-zero fails; one that is not
    primary (services) exiting 0 while a primary runs fails too; once every primary
    exited 0 the whole succeeds. A unit whose fate is not `shared` ends alone."""
    if code != 0 or (not primary and not primaries_done):
        return FAILS if shared else GOES_ON
    return SUCCEEDS if primaries_done else GOES_ON


def say(text: str) -> None:
    """One line for the attempt's log (train.log), where the poller reads the reason."""
    print(f"{MARK} {text}", flush=True)


class Stop(Exception):
    """The group must stop: `code` is the supervisor's exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Group:
    """The roles of one VM and their processes."""

    def __init__(self, config: dict[str, Any], directory: str) -> None:
        self.roles: list[dict[str, Any]] = list(config["roles"])
        self.checks: dict[str, dict[str, Any]] = dict(config.get("checks", {}))
        self.env: dict[str, str] = {str(k): str(v) for k, v in config.get("env", {}).items()}
        self.grace_s = float(config.get("grace_s", 10))
        self.stop_grace_s = float(config.get("stop_grace_s", 5))
        self.directory = directory
        self.procs: dict[str, Any] = {}
        self.codes: dict[str, int] = {}
        self.started_at: dict[str, float] = {}
        self.signalled: int | None = None
        self.backoff_s = float(config.get("restart_backoff_s", 1))
        self.backoff_max_s = float(config.get("restart_backoff_max_s", 30))
        self.live_every_s = float(config.get("live_every_s", 5))
        self.live_fail_s = float(config.get("live_fail_s", 30))
        self.restarts: dict[str, int] = {r["name"]: 0 for r in self.roles}
        self.restart_due: dict[str, float] = {}
        """Roles waiting out their backoff: when each starts again."""
        self.answered_at: dict[str, float] = {}
        """When each running role last passed its check (absent: not since it started)."""
        self.next_check: dict[str, float] = {}
        self.states: dict[str, dict[str, Any]] = {
            r["name"]: {"pid": None, "state": "waiting", "exit_code": None, "restarts": 0}
            for r in self.roles
        }
        self.write_states()

    def note(self, name: str, **fields: Any) -> None:
        """Record what a role is doing now in `roles.json` (what `job show` prints)."""
        self.states[name].update(fields)
        self.write_states()

    def write_states(self) -> None:
        """`roles.json`, atomically: each role's pid, state and exit code."""
        path = os.path.join(self.directory, ROLES_FILE)
        with contextlib.suppress(OSError):  # only informational: the group runs on
            with open(path + ".tmp", "w", encoding="utf-8") as handle:
                json.dump(self.states, handle)
            os.replace(path + ".tmp", path)

    # -- starting -------------------------------------------------------------------------

    def start(self, role: dict[str, Any], *, restart: int = 0) -> None:
        """Start one role in a process group of its own, its output in `<role>.log`
        (`restart`: the how-manieth restart in place this is)."""
        import subprocess

        name = role["name"]
        env = dict(os.environ)
        env.update(self.env)
        env.update({str(k): str(v) for k, v in role.get("env", {}).items()})
        progress = env.get("RLFLEET_PROGRESS_FILE")
        if progress and not os.path.isabs(progress):
            env["RLFLEET_PROGRESS_FILE"] = os.path.join(self.directory, progress)
        direct = [*LOOPBACK, *self.addresses(), *_node_addresses(env)]
        # One value for both spellings: a library reading either keeps the user's entries.
        given = f"{env.get('no_proxy', '')},{env.get('NO_PROXY', '')}"
        env["no_proxy"] = env["NO_PROXY"] = with_hosts(given, direct)
        argv = [expand(str(word), env) for word in role["argv"]]
        log_path = os.path.join(self.directory, f"{name}.log")
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    # The attempt's copy of the job's workdir, when it has one.
                    cwd=os.environ.get("RLFLEET_WORKDIR") or os.path.expanduser("~"),
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            except OSError as exc:
                say(f"role {name} cannot start: {exc.strerror or exc}: {argv[0]}")
                raise Stop(CANNOT_START_EXIT) from None
        self.procs[name] = proc
        self.started_at[name] = time.monotonic()
        self.answered_at.pop(name, None)
        self.next_check.pop(name, None)
        self.note(name, pid=proc.pid, state="running", exit_code=None)
        if restart:
            say(f"role {name} restarted, pid {proc.pid} (restart {restart} of {self.limit(name)})")
        else:
            say(f"role {name} started, pid {proc.pid}")

    def addresses(self) -> list[str]:
        """Where the group's roles are: every role's address and readiness-check host."""
        found = [v for k, v in self.env.items() if k.startswith("RLFLEET_") and k.endswith("_ADDR")]
        return found + [str(check.get("host", "")) for check in self.checks.values()]

    def wait_ready(self, name: str) -> None:
        """Wait until role `name` passes its readiness check (none: it only has to run)."""
        check = self.checks.get(name)
        if check is None:
            return
        timeout = float(check["timeout_s"])
        began = self.started_at.get(name, time.monotonic())  # another VM's: from now
        while True:
            self.watch()
            if probe(check):
                say(f"role {name} ready")
                if name in self.procs and name not in self.codes:
                    self.answered_at[name] = time.monotonic()
                return
            waited = time.monotonic() - began
            if waited >= timeout:
                say(f"role {name} not ready after {int(timeout)}s")
                raise Stop(NOT_READY_EXIT)
            time.sleep(min(0.5, max(0.05, timeout - waited)))

    # -- watching -------------------------------------------------------------------------

    def watch(self) -> bool:
        """Collect exits, restart the roles that heal in place, check the live ones;
        `Stop` when the group must end; True once every primary role exited 0."""
        if self.signalled is not None:
            raise Stop(128 + self.signalled)
        for name, proc in list(self.procs.items()):
            if name in self.codes:
                continue
            code = proc.poll()
            if code is None:
                continue
            code = 128 - code if code < 0 else code  # killed by a signal: 128 + N
            self.codes[name] = code
            self.note(name, state="exited", exit_code=code)
            say(f"role {name} exited with {code}")
            primary = bool(self.role(name).get("primary"))
            if unit_exit(primary, code, self.primaries_done()) != FAILS:
                continue
            if self.restart_later(name, "exited", code):
                continue
            after = self.after(name)
            if code != 0:
                say(f"role {name} failed (exit {code}){after}; stopping the group")
                raise Stop(ROLE_EXIT_MAP.get(code, code))
            say(f"role {name} exited while a primary role runs{after}; stopping the group")
            raise Stop(EARLY_SERVICE_EXIT)
        if self.primaries_done():
            return True
        self.start_due()
        self.check_live()
        return False

    # -- healing in place -----------------------------------------------------------------

    def limit(self, name: str) -> int:
        """How many restarts in place role `name` may have (0: none, shared fate)."""
        restart = self.role(name).get("restart")
        return int(restart.get("max", 0)) if isinstance(restart, dict) else 0

    def after(self, name: str) -> str:
        """` after N restarts` for a role restarted before, for the line that ends a group."""
        count = self.restarts[name]
        return f" after {count} restart{'s' if count != 1 else ''}" if count else ""

    def restart_later(self, name: str, cause: str, code: int | None) -> bool:
        """Schedule the restart in place of role `name`, which failed (`cause` in
        `RESTART_CAUSES`, `code` its exit code), after its backoff; False when it may not
        be restarted (none asked for, or `max` reached)."""
        count = self.restarts[name]
        if count >= self.limit(name):
            return False
        count += 1
        delay = min(self.backoff_s * 2 ** (count - 1), self.backoff_max_s)
        self.restarts[name] = count
        self.restart_due[name] = time.monotonic() + delay
        self.note(name, state="restarting", restarts=count, restart_cause=cause, restart_exit=code)
        why = f"failed (exit {code})" if cause == "exited" else "stopped answering its check"
        limit = self.limit(name)
        say(f"role {name} {why}; restarting it in {delay:g}s (restart {count} of {limit})")
        return True

    def start_due(self) -> None:
        """Start again the roles whose backoff is over, with what they started with."""
        now = time.monotonic()
        for name, due in list(self.restart_due.items()):
            if now < due:
                continue
            del self.restart_due[name]
            old = self.procs.pop(name)
            signal_group(old.pid, signal.SIGKILL)  # what the old one forked goes with it
            del self.codes[name]
            self.start(self.role(name), restart=self.restarts[name])

    def check_live(self) -> None:
        """Ask each running role this supervisor checks (`live`) its readiness check, every
        `live_every_s`: one that answered once and then fails for `live_fail_s` has stopped
        answering; one restarted in place must answer within its check's timeout again."""
        now = time.monotonic()
        for name in list(self.procs):
            check = self.checks.get(name)
            if check is None or not self.role(name).get("live") or name in self.codes:
                continue
            if now < self.next_check.get(name, 0.0):
                continue
            self.next_check[name] = now + self.live_every_s
            if probe(check):
                if name not in self.answered_at and self.restarts[name]:
                    say(f"role {name} ready again")
                self.answered_at[name] = time.monotonic()
                continue
            answered = self.answered_at.get(name)
            if answered is None:
                timeout = float(check["timeout_s"])
                if self.restarts[name] and now - self.started_at[name] >= timeout:
                    self.unresponsive(name, f"not ready after {int(timeout)}s")
                continue
            if now - answered >= self.live_fail_s:
                self.unresponsive(
                    name, f"stopped answering its readiness check for {int(self.live_fail_s)}s"
                )

    def unresponsive(self, name: str, why: str) -> None:
        """Role `name` does not answer: stopped and restarted in place when it may be,
        else `Stop` (the group ends)."""
        if self.restarts[name] >= self.limit(name):
            say(f"role {name} {why}{self.after(name)}; stopping the group")
            raise Stop(NOT_READY_EXIT)
        say(f"role {name} {why}; stopping it")
        proc = self.procs[name]
        signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        signal_group(proc.pid, signal.SIGKILL)
        code = proc.wait()
        self.codes[name] = 128 - code if code < 0 else code
        self.restart_later(name, "unresponsive", None)

    def primaries_done(self) -> bool:
        """Whether every primary role of this VM started and exited 0."""
        primaries = [r["name"] for r in self.roles if r.get("primary")]
        return bool(primaries) and all(self.codes.get(n) == 0 for n in primaries)

    def role(self, name: str) -> dict[str, Any]:
        """The role called `name`."""
        return next(r for r in self.roles if r["name"] == name)

    # -- stopping -------------------------------------------------------------------------

    def stop_all(self, grace_s: float) -> None:
        """TERM every running role's process group, KILL what is left after `grace_s`."""
        live = [(n, p) for n, p in self.procs.items() if n not in self.codes]
        for _name, proc in live:
            signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for _n, p in live):
            time.sleep(0.05)
        for name, proc in live:
            signal_group(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait()
            code = proc.returncode
            self.note(name, state="stopped", exit_code=128 - code if code < 0 else code)
            say(f"role {name} stopped")
        for name in self.restart_due:
            self.note(name, state="stopped")  # was waiting to start again: it will not
        for proc in self.procs.values():
            # A group may outlive its leader (workers it forked): nothing of a role stays.
            signal_group(proc.pid, signal.SIGKILL)

    def run(self) -> int:
        """Start the roles in order, watch them, and return the supervisor's exit code."""
        try:
            for role in self.roles:
                for dep in role.get("depends_on", []):
                    self.wait_ready(dep)
                self.start(role)
            while not self.watch():
                time.sleep(POLL_S)
        except Stop as stop:
            self.stop_all(self.stop_grace_s)
            return stop.code
        say(f"every primary role exited 0; stopping the others (KILL after {self.grace_s:g}s)")
        self.stop_all(self.grace_s)
        return 0


def expand(word: str, env: dict[str, str]) -> str:
    """`word` with `$RLFLEET_X` / `${RLFLEET_X}` replaced by the scheduler's variables (no
    shell runs the command; other `$` text stays as it is)."""
    import re

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return env.get(name, match.group(0))

    return re.sub(r"\$\{(RLFLEET_[A-Z0-9_]+)\}|\$(RLFLEET_[A-Z0-9_]+)", value, word)


def with_hosts(value: str, hosts: list[str]) -> str:
    """A `no_proxy` value: `value`'s entries, then each of `hosts` it lacks."""
    entries = [e.strip() for e in value.split(",") if e.strip()]
    for host in hosts:
        if host and host not in entries:
            entries.append(host)
    return ",".join(entries)


def _node_addresses(env: dict[str, str]) -> list[str]:
    """The VMs of a role on several nodes (its rank's variables), for `no_proxy`."""
    nodes = [a for a in env.get("RLFLEET_NODE_ADDRS", "").split(",") if a]
    return nodes + ([env["MASTER_ADDR"]] if env.get("MASTER_ADDR") else [])


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""An opener that ignores proxies: readiness checks go to the group's own addresses."""


def probe(check: dict[str, Any]) -> bool:
    """One readiness check: HTTP GET of the path answers 2xx (asked directly, never through
    a proxy, with the attempt's token when there is one), or the TCP port accepts."""
    host, port = str(check["host"]), int(check["port"])
    path = check.get("path")
    try:
        if path is None:
            with socket.create_connection((host, port), timeout=2):
                return True
        url = f"http://{_url_host(host)}:{port}{path}"
        token = os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(url, headers=headers)
        with _DIRECT.open(request, timeout=2) as answer:
            return bool(200 <= answer.status < 300)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _url_host(host: str) -> str:
    """An IPv6 address in brackets, as a URL needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by `pid`, if it still exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def die_with_parent() -> None:
    """In the child before exec: be KILLed if the supervisor dies (Linux), so a role never
    outlives a supervisor that was itself killed outright."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    """Run the group described by `argv[1]` (group.json in the attempt directory)."""
    path = argv[1]
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    group = Group(config, os.path.dirname(os.path.abspath(path)))

    def on_signal(signum: int, _frame: Any) -> None:
        group.signalled = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    return group.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
