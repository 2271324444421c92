"""One poll of a VM: the command (nvidia-smi twice plus the job status probe, one round
trip) and a pure parser of its output.

The parser never raises on what a VM prints: anything it cannot read becomes
`PollResult.error`, a one-line reason the poller stores in `vms.last_error` while it marks
the VM's GPUs unhealthy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.remote.layout import Attempt
from scheduler.remote.output import as_int, output_lines
from scheduler.remote.probe import RemoteJobState, parse_status, status_probe

GPU_QUERY = "index,uuid,name,memory.total,memory.used,utilization.gpu"
APPS_QUERY = "gpu_uuid,pid,used_memory"
_FORMAT = "--format=csv,noheader,nounits"

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

# What nvidia-smi prints where it cannot give a value; all mean "unknown", not an error.
_NOT_AVAILABLE = {
    "[N/A]",
    "N/A",
    "[Not Supported]",
    "[Insufficient Permissions]",
    "[Unknown Error]",
    "[GPU requires reset]",
    "",
}
_NO_APPS = ("No running processes found", "No running compute processes found")
_INT = re.compile(r"^-?\d+(\.\d+)?$")


@dataclass(frozen=True)
class GpuInfo:
    """One line of `--query-gpu`; None where nvidia-smi said N/A or the like."""

    index: int
    uuid: str
    name: str | None
    memory_total_mb: int | None
    memory_used_mb: int | None
    utilization_pct: int | None


@dataclass(frozen=True)
class ComputeApp:
    """One line of `--query-compute-apps`: a process using a GPU."""

    gpu_uuid: str
    pid: int | None
    used_memory_mb: int | None


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
    """Poll lines that run the shell command `check` in $HOME (as an attempt runs) and
    print its last lines of output and its exit status."""
    return [
        f"echo {CHECK}",
        f'rlfleet_out=$(cd "$HOME" && {check} 2>&1)',
        "rlfleet_rc=$?",
        'printf "%s\\n" "$rlfleet_out" | tail -n 3',
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
            f"echo {JOBS}",
            status_probe(jobs),
            f"echo {GPUS}",
            f"nvidia-smi --query-gpu={GPU_QUERY} {_FORMAT} 2>&1",
            f'echo "{GPUS_RC} $?"',
            f"echo {APPS}",
            f"nvidia-smi --query-compute-apps={APPS_QUERY} {_FORMAT} 2>&1",
            f'echo "{APPS_RC} $?"',
            *(check_command(check) if check is not None else []),
            f"echo {END}",
        ]
    )


def _sections(stdout: str) -> tuple[dict[str, list[str]], dict[str, int | None]]:
    sections: dict[str, list[str]] = {}
    rcs: dict[str, int | None] = {}
    current: str | None = None
    for line in output_lines(stdout):
        head = line.strip()
        if head in (GPUS, APPS, JOBS, CHECK, END):
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


def _number(text: str) -> int | None:
    value = text.strip()
    if value in _NOT_AVAILABLE:
        return None
    if not _INT.match(value):
        raise ValueError(f"not a number: {value!r}")
    return int(float(value))


def _clean(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip()]


def diagnose(lines: Sequence[str], rc: int | None) -> str | None:
    """A reason when nvidia-smi's output is one of its known failures, else None."""
    text = "\n".join(lines)
    first = next((line.strip() for line in lines if line.strip()), "")
    if "couldn't communicate with the NVIDIA driver" in text or rc == 9:
        return f"nvidia-smi cannot reach the NVIDIA driver (rc {rc}): {first}"
    if "No devices were found" in text or rc == 6:
        return "nvidia-smi: no devices were found (rc 6)"
    lost = next(
        (line.strip() for line in lines if "fallen off the bus" in line or "GPU is lost" in line),
        None,
    )
    if lost is not None:
        return f"a GPU has fallen off the bus: {lost}"
    if rc == 127 or "command not found" in text or "nvidia-smi: not found" in text:
        return "nvidia-smi not found on the VM"
    if rc is None:
        return "nvidia-smi output truncated (no exit status)"
    if rc != 0:
        return f"nvidia-smi failed (rc {rc}): {first or 'no output'}"
    return None


def parse_gpu_line(line: str) -> GpuInfo:
    """One `--query-gpu` csv line; `ValueError` when it is not one."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) < 6:
        raise ValueError(f"expected 6 fields, got {len(fields)}")
    # A name with a comma in it would split into more fields: rejoin the middle.
    index, uuid, rest = fields[0], fields[1], fields[2:]
    name = ", ".join(rest[:-3])
    if as_int(index) is None or index.startswith("-"):
        raise ValueError(f"bad index {index!r}")
    if not uuid.startswith(("GPU-", "MIG-")) or len(uuid) < 12:
        raise ValueError(f"bad uuid {uuid!r}")
    return GpuInfo(
        index=int(index),
        uuid=uuid,
        name=None if name in _NOT_AVAILABLE else name,
        memory_total_mb=_number(rest[-3]),
        memory_used_mb=_number(rest[-2]),
        utilization_pct=_number(rest[-1]),
    )


def parse_app_line(line: str) -> ComputeApp:
    """One `--query-compute-apps` csv line; `ValueError` when it is not one."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
        raise ValueError(f"expected 3 fields, got {len(fields)}")
    uuid, pid, used = fields
    if not uuid.startswith(("GPU-", "MIG-")):
        raise ValueError(f"bad uuid {uuid!r}")
    return ComputeApp(gpu_uuid=uuid, pid=_number(pid), used_memory_mb=_number(used))


def parse_gpus(lines: Sequence[str], rc: int | None) -> tuple[list[GpuInfo], str | None]:
    """The GPUs in a `--query-gpu` section, and the reason it cannot be trusted, if any."""
    lines = _clean(list(lines))
    reason = diagnose(lines, rc)
    if reason is not None:
        return [], reason
    gpus: list[GpuInfo] = []
    for n, line in enumerate(lines, 1):
        try:
            gpus.append(parse_gpu_line(line))
        except ValueError as exc:
            return [], f"unreadable nvidia-smi GPU line {n} ({exc}): {line[:120]!r}"
    if not gpus:
        return [], "nvidia-smi listed no GPUs"
    if len({g.index for g in gpus}) != len(gpus):
        return [], "nvidia-smi listed a GPU index twice"
    if len({g.uuid for g in gpus}) != len(gpus):
        return [], "nvidia-smi listed a GPU UUID twice"
    return sorted(gpus, key=lambda g: g.index), None


def parse_apps(lines: Sequence[str], rc: int | None) -> tuple[list[ComputeApp], str | None]:
    """The processes in a `--query-compute-apps` section, and a reason when unreadable."""
    lines = [line for line in _clean(list(lines)) if not line.startswith(_NO_APPS)]
    reason = diagnose(lines, rc)
    if reason is not None:
        return [], reason
    apps: list[ComputeApp] = []
    for n, line in enumerate(lines, 1):
        try:
            apps.append(parse_app_line(line))
        except ValueError as exc:
            return [], f"unreadable nvidia-smi process line {n} ({exc}): {line[:120]!r}"
    return apps, None


def parse_poll(stdout: str) -> PollResult:
    """Read the output of `poll_command`. Never raises: problems become `error`."""
    sections, rcs = _sections(stdout)
    # Job news is acted on only from a complete answer (the end marker came): the job
    # lines of a cut-off one may be cut short. A broken nvidia-smi does not void it.
    jobs = parse_status("\n".join(sections.get(JOBS, []))) if END in sections else {}
    check = _check(sections, rcs) if END in sections else None
    if GPUS not in sections:
        return PollResult(
            error="poll output has no GPU section (truncated?)", jobs=jobs, check=check
        )
    gpus, error = parse_gpus(sections[GPUS], rcs.get(GPUS_RC))
    if error is None:
        if APPS not in sections:
            return PollResult(
                error="poll output has no process section (truncated?)", jobs=jobs, check=check
            )
        apps, error = parse_apps(sections[APPS], rcs.get(APPS_RC))
    else:
        apps = []
    return PollResult(gpus=tuple(gpus), apps=tuple(apps), error=error, jobs=jobs, check=check)


def _check(sections: dict[str, list[str]], rcs: dict[str, int | None]) -> tuple[int, str] | None:
    """The check's (exit status, last line), or None when the poll ran none."""
    rc = rcs.get(CHECK_RC)
    if CHECK not in sections or rc is None:
        return None
    lines = _clean(sections[CHECK])
    return rc, (lines[-1][:300] if lines else "no output")
