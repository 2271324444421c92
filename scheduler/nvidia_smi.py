"""nvidia-smi on a VM: the queries a poll runs (`GPU_COMMAND`, `APPS_COMMAND`) and a pure
parser of their output. The poll that runs them with the attempt status probe is
`scheduler.poll`.

The parser never raises on what a VM prints: anything it cannot read becomes a one-line
reason (`diagnose`, `parse_gpus`, `parse_apps`), which the poller stores in
`vms.last_error` while it marks the VM's GPUs unhealthy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.remote.output import as_int

GPU_QUERY = "index,uuid,name,memory.total,memory.used,utilization.gpu"
APPS_QUERY = "gpu_uuid,pid,used_memory"
_FORMAT = "--format=csv,noheader,nounits"
GPU_COMMAND = f"nvidia-smi --query-gpu={GPU_QUERY} {_FORMAT}"
"""Lists the GPUs, one csv line each (`parse_gpus`)."""
APPS_COMMAND = f"nvidia-smi --query-compute-apps={APPS_QUERY} {_FORMAT}"
"""Lists the processes using a GPU, one csv line each (`parse_apps`)."""

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


LOAD_QUERY = "uuid,utilization.gpu,power.draw,power.limit"
LOAD_COMMAND = f"nvidia-smi --query-gpu={LOAD_QUERY} {_FORMAT}"
"""How hard each GPU works (`parse_loads`): asked only of a VM with live attempts, for the
hang check's GPU signal (`scheduler.hang`)."""


@dataclass(frozen=True)
class GpuLoad:
    """How hard one GPU works: utilization (%) and power drawn against its limit (W);
    None where nvidia-smi gave no value."""

    utilization_pct: int | None
    power_draw_w: float | None
    power_limit_w: float | None


def _watts(text: str) -> float | None:
    value = text.strip().removesuffix("W").strip()
    if value in _NOT_AVAILABLE or not _INT.match(value):
        return None
    number = float(value)
    return number if 0 <= number < 1e6 else None


def parse_loads(lines: Sequence[str]) -> dict[str, GpuLoad]:
    """GPU UUID → its load, from `LOAD_COMMAND`'s lines; a line it cannot read is left
    out (the GPU's load is then unknown). Never raises."""
    loads: dict[str, GpuLoad] = {}
    for line in _clean(list(lines)):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].startswith(("GPU-", "MIG-")):
            continue
        try:
            utilization = _number(fields[1].removesuffix("%").strip())
        except ValueError:
            utilization = None
        loads[fields[0][:96]] = GpuLoad(utilization, _watts(fields[2]), _watts(fields[3]))
    return loads
