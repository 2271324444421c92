"""One poll of a VM: the command (the attempt status probe, then nvidia-smi twice, and a
check of the VM's python when asked, in one round trip) and a pure parser of its output.

The parser never raises on what a VM prints: anything it cannot read becomes
`PollResult.error`, a one-line reason the poller stores in `vms.last_error` while it marks
the VM's GPUs unhealthy. The job lines are parsed by `remote.probe.parse_status`, the GPU
lines by `nvidia_smi`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.nvidia_smi import (
    APPS_COMMAND,
    GPU_COMMAND,
    LOAD_COMMAND,
    ComputeApp,
    GpuInfo,
    GpuLoad,
    parse_apps,
    parse_gpus,
    parse_loads,
)
from scheduler.output_cap import OUTPUT_LIMIT
from scheduler.remote.cgroup import parse_tracking, probe_lines
from scheduler.remote.env import VM_ENV_FILE, load_env_lines
from scheduler.remote.layout import Attempt, home_path
from scheduler.remote.output import NONBLOCK_LINES, as_int, output_lines
from scheduler.remote.probe import RemoteJobState, parse_status, status_probe
from scheduler.remote.restarts import RoleRestarts, parse_restarts

_MARK = "@@rlfleet"
GPUS, GPUS_RC, APPS, APPS_RC, JOBS, END = (
    f"{_MARK}-gpus",
    f"{_MARK}-gpus-rc",
    f"{_MARK}-apps",
    f"{_MARK}-apps-rc",
    f"{_MARK}-jobs",
    f"{_MARK}-end",
)
CHECK, CHECK_RC = f"{_MARK}-check", f"{_MARK}-check-rc"
LOADS = f"{_MARK}-loads"
TRACKING = f"{_MARK}-tracking"
ATTEMPT_BYTES = 256 * 1024
"""Room in a poll's answer for one attempt's lines: each file of it is read bounded
(`remote.probe.status_probe`), its log tail of 4 KB is at most ~200 KB once each of its
lines carries its prefix."""
CHECK_BYTES = 2048
"""Most bytes of the python check's last lines printed in a poll."""


def poll_output_limit(attempts: int) -> int:
    """Most bytes of a poll's stdout kept (the transport's cap): `OUTPUT_LIMIT` for the
    VM's own sections (nvidia-smi), and `ATTEMPT_BYTES` for each attempt probed. A longer
    answer is cut, and the poller ignores it (`cut_poll`)."""
    return OUTPUT_LIMIT + ATTEMPT_BYTES * max(0, attempts)


def cut_poll(limit: int, dropped: int) -> PollResult:
    """What a poll whose answer went past `limit` bytes learned: nothing to act on."""
    return PollResult(error=f"poll answer past {limit} bytes ({dropped} more dropped): ignored")


@dataclass(frozen=True)
class PollResult:
    """Everything one poll learned about a VM."""

    gpus: tuple[GpuInfo, ...] = ()
    apps: tuple[ComputeApp, ...] = ()
    error: str | None = None
    """Why the GPUs cannot be trusted (driver gone, GPU lost, garbage…); None when fine."""
    jobs: dict[tuple[int, int], RemoteJobState] = field(default_factory=dict)
    check: tuple[int, str] | None = None
    """The check of the VM's python and entrypoint, when the poll ran one: (exit status,
    last line of its output). None: not asked for, or its answer was cut off."""
    restarts: dict[tuple[int, int], dict[str, RoleRestarts]] = field(default_factory=dict)
    """The restarts in place of each job group attempt's roles, as its supervisor counts
    them (`remote.restarts`), by (job id, attempt) and role; only from a complete answer."""
    loads: dict[str, GpuLoad] = field(default_factory=dict)
    """GPU UUID → how hard it works (utilization, power), asked only of a VM that runs
    attempts: the hang check's GPU signal (`scheduler.hang`)."""
    tracking: str | None = None
    """How the VM tracks an attempt's processes (`remote.cgroup.parse_tracking`): a cgroup
    v2 per attempt, or the environment marker; None: the answer was cut off or unreadable."""

    def busy_uuids(self) -> set[str]:
        """UUIDs of the GPUs some process is using.

        A process on a GPU uuid that matches no listed GPU (a MIG instance, a GPU that just
        disappeared) could be on any of them, so then every GPU counts as busy: better to
        offer none than to put two users on one GPU.
        """
        listed = {g.uuid for g in self.gpus}
        busy: set[str] = set()
        for app in self.apps:
            if app.gpu_uuid not in listed:
                return listed
            busy.add(app.gpu_uuid)
        return busy


def check_command(check: str) -> list[str]:
    """Poll lines that run the shell command `check` in $HOME with the VM's env file
    loaded and no PYTHONPATH but the one it sets (as the wrapper's check runs, so that both
    agree) and print its last lines of output and its exit status."""
    return [
        f"echo {CHECK}",
        'rlfleet_out=$(cd "$HOME" && unset PYTHONPATH',
        *load_env_lines([home_path(VM_ENV_FILE)]),
        f"{check} 2>&1)",
        "rlfleet_rc=$?",
        f'printf "%s\\n" "$rlfleet_out" | tail -n 3 | tail -c {CHECK_BYTES}',
        f'echo "{CHECK_RC} $rlfleet_rc"',
    ]


def poll_command(jobs: Sequence[Attempt], check: str | None = None) -> str:
    """The shell text of one poll: GPUs, compute apps and the status of `jobs`, and the
    shell command `check` (a VM's python and entrypoint), when given.

    nvidia-smi's stderr is folded into its section because its errors (driver, lost GPU)
    are what the parser needs to see. The jobs are probed first: a process still on the
    GPU of an attempt that had already ended is then surely not that attempt's (a child it
    left behind, or someone else's), and the poller can keep that GPU out of use.
    """
    return "\n".join(
        [
            *NONBLOCK_LINES,
            f"echo {JOBS}",
            status_probe(jobs),
            f"echo {GPUS}",
            f"{GPU_COMMAND} 2>&1",
            f'echo "{GPUS_RC} $?"',
            f"echo {APPS}",
            f"{APPS_COMMAND} 2>&1",
            f'echo "{APPS_RC} $?"',
            *(check_command(check) if check is not None else []),
            # Only a VM running attempts is asked how hard its GPUs work (the hang check).
            *([f"echo {LOADS}", f"{LOAD_COMMAND} 2>/dev/null"] if jobs else []),
            # Whether a launch now would get a cgroup (`remote.cgroup`), in a subshell.
            f"echo {TRACKING}",
            "(",
            *probe_lines(),
            ") 2>/dev/null",
            f"echo {END}",
        ]
    )


def _sections(stdout: str) -> tuple[dict[str, list[str]], dict[str, int | None]]:
    sections: dict[str, list[str]] = {}
    rcs: dict[str, int | None] = {}
    current: str | None = None
    for line in output_lines(stdout):
        head = line.strip()
        if head in (GPUS, APPS, JOBS, CHECK, LOADS, TRACKING, END):
            current = head
            sections.setdefault(head, [])
            continue
        if head.startswith((GPUS_RC + " ", APPS_RC + " ", CHECK_RC + " ")):
            name, _, value = head.partition(" ")
            rcs[name] = as_int(value)
            current = None
            continue
        if current is not None:
            sections[current].append(line)
    return sections, rcs


def parse_poll(stdout: str) -> PollResult:
    """Read the output of `poll_command`. Never raises: problems become `error`."""
    sections, rcs = _sections(stdout)
    # Job news is acted on only from a complete answer (the end marker came): the job
    # lines of a cut-off one may be cut short. A broken nvidia-smi does not void it.
    jobs = parse_status("\n".join(sections.get(JOBS, []))) if END in sections else {}
    check = _check(sections, rcs) if END in sections else None
    restarts = parse_restarts("\n".join(sections.get(JOBS, []))) if END in sections else {}
    loads = parse_loads(sections.get(LOADS, [])) if END in sections else {}
    tracking = parse_tracking(sections.get(TRACKING, [])) if END in sections else None
    if GPUS not in sections:
        return PollResult(
            error="poll output has no GPU section (truncated?)",
            jobs=jobs,
            check=check,
            restarts=restarts,
            tracking=tracking,
        )
    gpus, error = parse_gpus(sections[GPUS], rcs.get(GPUS_RC))
    if error is None:
        if APPS not in sections:
            return PollResult(
                error="poll output has no process section (truncated?)",
                jobs=jobs,
                check=check,
                restarts=restarts,
                tracking=tracking,
            )
        apps, error = parse_apps(sections[APPS], rcs.get(APPS_RC))
    else:
        apps = []
    return PollResult(
        gpus=tuple(gpus),
        apps=tuple(apps),
        error=error,
        jobs=jobs,
        check=check,
        restarts=restarts,
        loads=loads,
        tracking=tracking,
    )


def _check(sections: dict[str, list[str]], rcs: dict[str, int | None]) -> tuple[int, str] | None:
    """The check's (exit status, last line), or None when the poll ran none."""
    rc = rcs.get(CHECK_RC)
    if CHECK not in sections or rc is None:
        return None
    lines = [line.strip() for line in sections[CHECK] if line.strip()]
    return rc, (lines[-1][:300] if lines else "no output")
