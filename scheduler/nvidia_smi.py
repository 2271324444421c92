"""nvidia-smi on a VM: the queries a poll runs (`GPU_COMMAND`, `APPS_COMMAND`) and a pure
parser of their output. The poll that runs them with the attempt status probe is
`scheduler.poll`.

The parser never raises on what a VM prints: anything it cannot read becomes a one-line
reason (`diagnose`, `parse_gpus`, `parse_apps`), which the poller stores in
`vms.last_error` while it marks the VM's GPUs unhealthy. What one GPU says of its own
health (ECC, pending retirement or remapping, a fault marker in a field) is read into its
`GpuInfo`; what that means for the GPU is `scheduler.gpu_health`'s to decide.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.remote.output import as_int

BASE_QUERY = "index,uuid,name,memory.total,memory.used,utilization.gpu"
ECC_FIELD = "ecc.errors.uncorrected.volatile.total"
RETIRED_FIELD = "retired_pages.pending"
REMAPPED_FIELD = "remapped_rows.pending"
HEALTH_QUERY = f"{ECC_FIELD},{RETIRED_FIELD},{REMAPPED_FIELD}"
"""The health fields read with every poll (docs/gpu-health.md). A GPU or driver that does
not support one answers `[N/A]` or `[Not Supported]` for it: unknown, not unhealthy."""
GPU_QUERY = f"{BASE_QUERY},{HEALTH_QUERY}"
GPU_QUERIES = (GPU_QUERY, f"{BASE_QUERY},{ECC_FIELD},{RETIRED_FIELD}", BASE_QUERY)
"""The GPU queries a poll tries in turn: a driver older than a field refuses the whole
query ("is not a valid field"), so the next one, with fewer health fields, is asked in the
same round trip (row remapping came with later drivers than ECC and page retirement)."""
APPS_QUERY = "gpu_uuid,pid,used_memory"
_FORMAT = "--format=csv,noheader,nounits"
QUERY_MARK = "@@rlfleet-gpus-query"
"""Printed before the GPU lines with the query that answered (one of `GPU_QUERIES`)."""
GPU_COMMAND = (
    f"for rlfleet_q in {' '.join(GPU_QUERIES)}; do\n"
    f'  rlfleet_gpus=$(nvidia-smi --query-gpu="$rlfleet_q" {_FORMAT} 2>&1); rlfleet_gpus_rc=$?\n'
    '  case "$rlfleet_gpus" in *"is not a valid field"*) ;; *) break ;; esac\n'
    "done\n"
    f'echo "{QUERY_MARK} $rlfleet_q"\n'
    """printf '%s\\n' "$rlfleet_gpus"\n"""
    "(exit $rlfleet_gpus_rc)"
)
"""Lists the GPUs, one csv line each (`parse_gpus`), with the health fields the driver
knows; its exit status is nvidia-smi's."""
APPS_COMMAND = f"nvidia-smi --query-compute-apps={APPS_QUERY} {_FORMAT}"
"""Lists the processes using a GPU, one csv line each (`parse_apps`)."""

# What nvidia-smi prints where it cannot give a value: "unknown", not an error.
_NOT_AVAILABLE = {
    "[N/A]",
    "N/A",
    "[Not Supported]",
    "[Insufficient Permissions]",
    "",
}
FAULT_MARKERS = ("[GPU requires reset]", "[Unknown Error]", "ERR!")
"""What nvidia-smi prints in a field of a GPU that is broken: that GPU is unhealthy
(`GpuInfo.fault`); the field's value is unknown."""
_YES = {"yes", "1", "true", "enabled"}
_NO = {"no", "0", "false", "disabled"}
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
    ecc_uncorrected: int | None = None
    """`ecc.errors.uncorrected.volatile.total`: None when not reported (no ECC, old driver)."""
    retired_pending: bool | None = None
    """`retired_pages.pending`: pages waiting to be retired at the next reset."""
    remapped_pending: bool | None = None
    """`remapped_rows.pending`: rows waiting to be remapped at the next reset."""
    fault: str | None = None
    """The first fault marker (`FAULT_MARKERS`) nvidia-smi printed in a field of this GPU:
    it requires a reset or cannot be read. None: none."""


@dataclass(frozen=True)
class ComputeApp:
    """One line of `--query-compute-apps`: a process using a GPU."""

    gpu_uuid: str
    pid: int | None
    used_memory_mb: int | None


def _fault(text: str) -> str | None:
    """The fault marker in a field, if any."""
    return next((m for m in FAULT_MARKERS if m in text), None)


INT32 = (-(2**31), 2**31 - 1)
"""The range of the `gpus` columns a reading is stored in (memory, utilisation)."""
COUNT = (0, 2**63 - 1)
"""The range of a count stored in a BIGINT column (ECC errors)."""


def _number(text: str, bounds: tuple[int, int] = INT32) -> int | None:
    """A numeric field; None when unknown. `ValueError` when it is not a number or out of
    `bounds` (what its column holds: one VM's absurd value must not fail the batch that
    writes every VM's poll)."""
    value = text.strip()
    if value in _NOT_AVAILABLE or _fault(value) is not None:
        return None
    if not _INT.match(value) or len(value) > 40:
        raise ValueError(f"not a number: {value[:40]!r}")
    number = int(float(value)) if "." in value else int(value)
    if not bounds[0] <= number <= bounds[1]:
        raise ValueError(f"out of range: {value[:40]}")
    return number


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


def _flag(text: str) -> bool | None:
    """A yes/no field (`Yes`/`No`, or a count: pending when above 0); None when unknown,
    including a value in a form this parser does not know (a health field read wrongly
    must not distrust the whole VM: the listing itself is still checked)."""
    value = text.strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    if value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value) > 0
    return None


def parse_gpu_line(line: str, *, query: str | None = None) -> GpuInfo:
    """One `--query-gpu` csv line of `query` (one of `GPU_QUERIES`); `ValueError` when it
    is not one. None: `GPU_QUERY` when the line has at least its 9 fields, else
    `BASE_QUERY`."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) < 6:
        raise ValueError(f"expected 6 fields, got {len(fields)}")
    if query is None:
        query = GPU_QUERY if len(fields) >= 9 else BASE_QUERY
    names = query.split(",")
    if len(fields) < len(names):
        raise ValueError(f"expected {len(names)} fields, got {len(fields)}")
    tail = len(names) - 3
    # A name with a comma in it would split into more fields: rejoin the middle.
    index, uuid, rest = fields[0], fields[1], fields[2:]
    name = ", ".join(rest[:-tail])
    values = dict(zip(names[3:], rest[-tail:], strict=True))
    if as_int(index) is None or index.startswith("-"):
        raise ValueError(f"bad index {index!r}")
    if not uuid.startswith(("GPU-", "MIG-")) or len(uuid) < 12:
        raise ValueError(f"bad uuid {uuid!r}")
    fault = next((f for f in map(_fault, rest) if f is not None), None)
    return GpuInfo(
        index=int(index),
        uuid=uuid,
        name=None if name in _NOT_AVAILABLE or _fault(name) else name,
        memory_total_mb=_number(values["memory.total"]),
        memory_used_mb=_number(values["memory.used"]),
        utilization_pct=_number(values["utilization.gpu"]),
        ecc_uncorrected=_number(values[ECC_FIELD], COUNT) if ECC_FIELD in values else None,
        retired_pending=_flag(values[RETIRED_FIELD]) if RETIRED_FIELD in values else None,
        remapped_pending=_flag(values[REMAPPED_FIELD]) if REMAPPED_FIELD in values else None,
        fault=fault,
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


LOST_RC = 15
"""nvidia-smi's exit status when a GPU is lost (fallen off the bus) and it listed the rest."""
_LOST_MARKS = ("fallen off the bus", "GPU is lost")


def _without_lost(lines: list[str], rc: int | None) -> tuple[list[str], int | None]:
    """The lines and exit status to read when nvidia-smi reported a lost GPU but listed
    others: those others are read as usual (the lost one is the GPU the listing misses,
    `scheduler.gpu_health`), not the whole VM distrusted. Otherwise unchanged."""
    lost = [line for line in lines if any(m in line for m in _LOST_MARKS)]
    rest = [line for line in lines if line not in lost]
    if lost and rest and rc in (0, LOST_RC):
        return rest, 0
    return lines, rc


def parse_gpus(lines: Sequence[str], rc: int | None) -> tuple[list[GpuInfo], str | None]:
    """The GPUs in a `--query-gpu` section, and the reason it cannot be trusted, if any.
    A GPU reported lost beside others that are listed is simply not listed (per GPU, not
    the VM); a lost GPU with nothing else listed distrusts the VM."""
    lines = _clean(list(lines))
    marks = [line for line in lines if line.startswith(QUERY_MARK + " ")]
    query = marks[-1].removeprefix(QUERY_MARK + " ") if marks else None
    lines, rc = _without_lost([line for line in lines if line not in marks], rc)
    reason = diagnose(lines, rc)
    if reason is not None:
        return [], reason
    if query is not None and query not in GPU_QUERIES:
        return [], f"nvidia-smi answered an unknown GPU query: {query[:120]!r}"
    gpus: list[GpuInfo] = []
    for n, line in enumerate(lines, 1):
        try:
            gpus.append(parse_gpu_line(line, query=query))
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
    if rc == LOST_RC and lines and all(any(m in line for m in _LOST_MARKS) for line in lines):
        lines, rc = [], 0  # only the lost GPU's complaint: no process listed
    else:
        lines, rc = _without_lost(lines, rc)
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
