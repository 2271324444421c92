"""A simulated `nvidia-smi`, for machines without a GPU: `rlfleet up --gpus N` (CPU-only
trials) and the test fleet. The GPU is the one thing rlfleet ever simulates.

`install(bin_dir, config_path, config)` writes the JSON config and an `nvidia-smi` in
`bin_dir` that runs this file as a script (`python -S sim_gpu.py CONFIG ARGS…`); it imports
nothing outside the standard library, because it runs on every poll of every VM.

The config: `name` and optional `fleet` (a GPU shows as used while a live process whose
environment has `RLFLEET_SIM_VM=<name>`, and `RLFLEET_SIM_FLEET=<fleet>` when set, names
it in `CUDA_VISIBLE_DEVICES`), `fail` (None or one of FAIL_MODES: fail as a broken real
one does), `process_mb`, and `gpus`: a list of `{index, uuid, name, memory, speed}`, each
with an optional `busy_power` (watts drawn while in use) and `power_limit`, and
optionally with the health a real one reports (`set_health`): `ecc` (uncorrected volatile
ECC errors), `retired_pending`, `remapped_pending` (booleans), `fault` (a marker such as
`[GPU requires reset]`, `[Unknown Error]` or `ERR!`, printed in every field but index and
UUID), `unsupported` (health fields answered `[N/A]`/`[Not Supported]`), and `vanished`
(not listed at all, as a GPU that dropped off does). `old_driver` in the config refuses
the health fields (True: all of them; a list: those) the way a driver older than them
does.

Which GPUs a process uses is read from its `CUDA_VISIBLE_DEVICES` the way CUDA reads it
(`devices_of`): a UUID names that GPU; a number is a position in CUDA's order, which is
fastest first (higher `speed`, ties by index) unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, when
it is nvidia-smi's index. So a VM of mixed models (`make_config(models=…)`) numbers its
GPUs differently for CUDA and nvidia-smi, as a real one does, and `reorder` renumbers
nvidia-smi's indices as a reboot or a removed card can.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VM_ENV = "RLFLEET_SIM_VM"
FLEET_ENV = "RLFLEET_SIM_FLEET"
FAIL_MODES = ("driver", "no_devices", "fallen_off_bus", "garbage")
HEALTH_KEYS = ("ecc", "retired_pending", "remapped_pending", "fault", "unsupported", "vanished")
"""Per-GPU health settings (`set_health`)."""
HEALTH_FIELDS = (
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
)
DRIVER_FAILURE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
GPU_LOST = (
    "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  "
    "Reboot the system to recover this GPU"
)


def gpu_uuid(vm_name: str, index: int) -> str:
    """The stable UUID reported for GPU `index` of the simulated VM `vm_name`."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'rlfleet-sim/{vm_name}/{index}')}"


def make_config(
    name: str,
    gpus: int,
    *,
    gpu_name: str,
    memory_mb: int,
    fleet: str | None = None,
    process_mb: int = 1024,
    models: Sequence[tuple[str, int, int]] | None = None,
) -> dict[str, Any]:
    """The config of a VM with `gpus` GPUs, none failing: identical ones, or one per entry
    of `models`, `(name, memory_mb, speed)` in nvidia-smi's index order."""
    kinds = list(models) if models is not None else [(gpu_name, memory_mb, 0)] * gpus
    return {
        "name": name,
        "fleet": fleet,
        "fail": None,
        "process_mb": process_mb,
        "gpus": [
            {"index": i, "uuid": gpu_uuid(name, i), "name": n, "memory": mb, "speed": speed}
            for i, (n, mb, speed) in enumerate(kinds)
        ],
    }


def reorder(config: dict[str, Any], uuids: Sequence[str]) -> None:
    """Renumber the GPUs: the one with `uuids[i]` gets nvidia-smi index i; a GPU not named
    is taken out (a removed or lost card)."""
    by_uuid = {g["uuid"]: g for g in config["gpus"]}
    config["gpus"] = [{**by_uuid[u], "index": i} for i, u in enumerate(uuids)]


def set_health(config: dict[str, Any], index: int, **health: Any) -> None:
    """Set health values of the GPU with nvidia-smi index `index` (`HEALTH_KEYS`); a value
    of None removes the setting (back to a healthy GPU)."""
    unknown = set(health) - set(HEALTH_KEYS)
    if unknown:
        raise ValueError(f"unknown GPU health settings {sorted(unknown)}; use {HEALTH_KEYS}")
    gpu = next(g for g in config["gpus"] if int(g["index"]) == index)
    for key, value in health.items():
        if value is None:
            gpu.pop(key, None)
        else:
            gpu[key] = value


def cuda_order(gpus: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs in CUDA's default (fastest first) order."""
    return sorted(gpus, key=lambda g: (-int(g.get("speed", 0)), int(g["index"])))


def devices_of(gpus: Sequence[dict[str, Any]], env: dict[str, str]) -> list[str]:
    """The UUIDs of the GPUs a process with environment `env` uses, read as CUDA reads
    `CUDA_VISIBLE_DEVICES`: a UUID (or a unique prefix of one) names that GPU, a number
    its position in CUDA's order; reading stops at the first entry that names none."""
    pci = env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    order = sorted(gpus, key=lambda g: int(g["index"])) if pci else cuda_order(gpus)
    found: list[str] = []
    for part in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
        part = part.strip()
        if part.isdigit() and int(part) < len(order):
            found.append(order[int(part)]["uuid"])
            continue
        named = [g["uuid"] for g in gpus if part and g["uuid"].startswith(part)]
        if len(named) != 1:
            break
        found.append(named[0])
    return found


def write_config(config_path: Path, config: dict[str, Any]) -> None:
    """Replace the config atomically (a poll may read it at any moment)."""
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config))
    os.replace(tmp, config_path)


def install(bin_dir: Path, config_path: Path, config: dict[str, Any]) -> Path:
    """Write the config and `bin_dir/nvidia-smi`; returns the executable's path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    write_config(config_path, config)
    smi = bin_dir / "nvidia-smi"
    argv = [sys.executable, "-S", str(Path(__file__).resolve()), str(config_path.resolve())]
    smi.write_text(f'#!/bin/sh\nexec {" ".join(shlex.quote(a) for a in argv)} "$@"\n')
    smi.chmod(0o755)
    return smi


def _holders(cfg: dict[str, Any]) -> dict[str, list[int]]:
    """GPU UUID → pids of the live processes of this VM that use it."""
    found: dict[str, list[int]] = {}
    me = os.getpid()
    name, fleet = cfg["name"].encode(), (cfg.get("fleet") or "").encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if env.get(VM_ENV.encode()) != name or (fleet and env.get(FLEET_ENV.encode()) != fleet):
            continue
        text = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in env.items()}
        for uuid_ in devices_of(cfg["gpus"], text):
            found.setdefault(uuid_, []).append(int(entry))
    return found


def _health_field(field: str, gpu: dict[str, Any]) -> str:
    if gpu.get("unsupported"):
        return "[Not Supported]" if field == HEALTH_FIELDS[0] else "[N/A]"
    if field == HEALTH_FIELDS[0]:
        return str(int(gpu.get("ecc", 0)))
    key = "retired_pending" if field == HEALTH_FIELDS[1] else "remapped_pending"
    return "Yes" if gpu.get(key) else "No"


def _gpu_field(field: str, gpu: dict[str, Any], pids: list[int], mb: int, units: bool) -> str:
    if gpu.get("fault") and field not in ("index", "uuid", "gpu_uuid"):
        return str(gpu["fault"])
    if field in HEALTH_FIELDS:
        return _health_field(field, gpu)
    used = mb * len(pids)
    values = {
        "index": str(gpu["index"]),
        "uuid": gpu["uuid"],
        "gpu_uuid": gpu["uuid"],
        "name": gpu["name"],
        "gpu_name": gpu["name"],
        "memory.total": f"{gpu['memory']}" + (" MiB" if units else ""),
        "memory.used": f"{used}" + (" MiB" if units else ""),
        "memory.free": f"{gpu['memory'] - used}" + (" MiB" if units else ""),
        "utilization.gpu": ("100" if pids else "0") + (" %" if units else ""),
        # A GPU in use draws `busy_power` (a hung collective: 100 % busy at low power).
        "power.draw": f"{_power(gpu, pids):.2f}" + (" W" if units else ""),
        "power.limit": f"{float(gpu.get('power_limit', POWER_LIMIT_W)):.2f}"
        + (" W" if units else ""),
    }
    return values.get(field, "[N/A]")


POWER_LIMIT_W = 400.0
"""A simulated GPU's power limit, unless its config gives `power_limit`."""
BUSY_POWER_W = 300.0
"""What a simulated GPU in use draws, unless its config gives `busy_power`."""
IDLE_POWER_W = 60.0
"""What a simulated GPU no process uses draws."""


def _power(gpu: dict[str, Any], pids: list[int]) -> float:
    return float(gpu.get("busy_power", BUSY_POWER_W)) if pids else IDLE_POWER_W


def main(argv: list[str]) -> int:
    """Answer like nvidia-smi, for the config file `argv[0]` and nvidia-smi's `argv[1:]`."""
    cfg = json.loads(Path(argv[0]).read_text())
    mode = cfg.get("fail")
    if mode == "driver":
        print(DRIVER_FAILURE)
        return 9
    if mode == "no_devices":
        print("No devices were found")
        return 6
    if mode == "garbage":
        print("0, GPU-3f1c2a9e-77, NVIDIA A1")
        print("\x00\x7f#### ??")
        return 0
    options = dict(a.partition("=")[::2] for a in argv[1:])
    fmt = options.get("--format", "")
    units, header = "nounits" not in fmt, "noheader" not in fmt
    gpus = [
        g
        for g in cfg["gpus"]
        if not (mode == "fallen_off_bus" and g["index"] == 0) and not g.get("vanished")
    ]
    if mode == "fallen_off_bus":
        print(GPU_LOST)
    holders = _holders(cfg)
    mb = int(cfg.get("process_mb", 1024))
    for key in ("--query-gpu", "--query-compute-apps"):
        if key not in options:
            continue
        fields = [f.strip() for f in options[key].split(",")]
        # A driver older than a field refuses the whole query (any other field the
        # simulation has no value of is answered [N/A]).
        old = cfg.get("old_driver")
        too_new = HEALTH_FIELDS if old is True else tuple(old or ())
        refused = [f for f in fields if f in too_new]
        if refused:
            print(f'Field "{refused[0]}" is not a valid field to query.')
            print("")
            print("Please run 'nvidia-smi --help-query-gpu' for more information.")
            return 2
        if header:
            print(", ".join(fields))
        for gpu in gpus:
            pids = holders.get(gpu["uuid"], [])
            if key == "--query-gpu":
                print(", ".join(_gpu_field(f, gpu, pids, mb, units) for f in fields))
                continue
            for pid in pids:
                row = {"pid": str(pid), "used_memory": f"{mb}" + (" MiB" if units else "")}
                print(", ".join(row.get(f) or _gpu_field(f, gpu, [pid], mb, units) for f in fields))
    if not any(k in options for k in ("--query-gpu", "--query-compute-apps")):
        for gpu in gpus:
            pids = holders.get(gpu["uuid"], [])
            state = f"in use by {','.join(map(str, pids))}" if pids else "free"
            print(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']}) {state}")
    return 15 if mode == "fallen_off_bus" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
