"""The simulated nvidia-smi reads `CUDA_VISIBLE_DEVICES` as CUDA does (the one stand-in
the tests use must not hide a device-numbering bug)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler import sim_gpu
from scheduler.nvidia_smi import LOAD_COMMAND, GpuLoad, parse_loads

MODELS = [("T4", 15360, 1), ("H100", 81559, 3), ("A100", 40960, 2)]


def test_numbers_are_fastest_first_unless_pci_bus_order_is_asked_for() -> None:
    cfg = sim_gpu.make_config("vm", 0, gpu_name="", memory_mb=0, models=MODELS)
    t4, h100, a100 = (g["uuid"] for g in cfg["gpus"])
    gpus = cfg["gpus"]
    assert sim_gpu.devices_of(gpus, {"CUDA_VISIBLE_DEVICES": "0,2"}) == [h100, t4]
    pci = {"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert sim_gpu.devices_of(gpus, pci) == [t4, a100]
    assert sim_gpu.devices_of(gpus, {"CUDA_VISIBLE_DEVICES": f"{a100},{t4}"}) == [a100, t4]
    # CUDA stops at the first entry that names no device.
    assert sim_gpu.devices_of(gpus, {"CUDA_VISIBLE_DEVICES": f"{a100},GPU-nope,0"}) == [a100]
    assert sim_gpu.devices_of(gpus, {}) == []


def test_reorder_renumbers_and_drops_a_card() -> None:
    cfg = sim_gpu.make_config("vm", 0, gpu_name="", memory_mb=0, models=MODELS)
    t4, h100, a100 = (g["uuid"] for g in cfg["gpus"])
    sim_gpu.reorder(cfg, [a100, t4])
    assert [(g["index"], g["uuid"]) for g in cfg["gpus"]] == [(0, a100), (1, t4)]
    pci = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert sim_gpu.devices_of(cfg["gpus"], pci) == [t4]
    assert h100 not in {g["uuid"] for g in cfg["gpus"]}


def test_a_gpu_in_use_draws_its_busy_power_and_an_idle_one_little(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hang check's GPU signal: the load query (`nvidia_smi.LOAD_COMMAND`) as the
    simulated nvidia-smi answers it, parsed by the poller's parser."""
    cfg = sim_gpu.make_config("vm-power", 2, gpu_name="H100", memory_mb=81559)
    cfg["gpus"][1]["busy_power"] = 80.0  # a hung collective: busy at low power
    path = tmp_path / "sim.json"
    sim_gpu.write_config(path, cfg)
    args = LOAD_COMMAND.split()[1:]
    assert sim_gpu.main([str(path), *args]) == 0
    loads = parse_loads(capsys.readouterr().out.splitlines())
    idle = sim_gpu.IDLE_POWER_W
    assert loads == {g["uuid"]: GpuLoad(0, idle, sim_gpu.POWER_LIMIT_W) for g in cfg["gpus"]}
    gpu = cfg["gpus"][1]
    assert sim_gpu._gpu_field("power.draw", gpu, [123], 1024, False) == "80.00"
    assert sim_gpu._gpu_field("power.draw", cfg["gpus"][0], [123], 1024, True) == "300.00 W"
    assert sim_gpu._gpu_field("utilization.gpu", gpu, [123], 1024, False) == "100"
