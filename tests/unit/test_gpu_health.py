"""GPU health: the health fields of a poll (real nvidia-smi formats), the simulated
nvidia-smi that reports them, and the health transitions (`scheduler.gpu_health`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from scheduler import sim_gpu
from scheduler.gpu_health import CLEAR_POLLS, ECC, FAULT, LOST, Health, condition, step
from scheduler.nvidia_smi import BASE_QUERY, QUERY_MARK, GpuInfo, parse_gpu_line
from scheduler.poll import parse_poll, poll_command
from tests.unit.test_poll import U0, U1, poll_output

OK = f"0, {U0}, NVIDIA H100 80GB HBM3, 81559, 4, 0, 0, No, No"


def gpu(**health: object) -> GpuInfo:
    values: dict[str, object] = dict(
        index=0, uuid=U0, name="H100", memory_total_mb=1, memory_used_mb=0, utilization_pct=0
    )
    return GpuInfo(**{**values, **health})  # type: ignore[arg-type]


# -- parser ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (OK, (0, False, False, None)),
        (f"0, {U0}, NVIDIA H100, 81559, 4, 0, 2, Yes, No", (2, True, False, None)),
        (f"0, {U0}, NVIDIA H100, 81559, 4, 0, 0, No, Yes", (0, False, True, None)),
        # A GPU or driver that does not support a field: unknown, not unhealthy.
        (f"0, {U0}, NVIDIA T4, 15360, 4, 0, [N/A], [N/A], [N/A]", (None, None, None, None)),
        (
            f"0, {U0}, NVIDIA RTX 4090, 24564, 4, 0, [Not Supported], [Not Supported], "
            "[Not Supported]",
            (None, None, None, None),
        ),
        # A GPU that needs a reset or cannot be read says so in its fields.
        (
            f"0, {U0}, [GPU requires reset], [GPU requires reset], [GPU requires reset], "
            "[GPU requires reset], [GPU requires reset], [GPU requires reset], "
            "[GPU requires reset]",
            (None, None, None, "[GPU requires reset]"),
        ),
        (
            f"0, {U0}, NVIDIA A100, 81920, [Unknown Error], 0, 0, No, No",
            (0, False, False, "[Unknown Error]"),
        ),
        (f"0, {U0}, NVIDIA A100, 81920, 4, ERR!, 0, No, No", (0, False, False, "ERR!")),
        # A name with commas in it is still rejoined.
        (f"0, {U0}, Tesla V100, SXM2, 16384, 0, 0, 1, No, No", (1, False, False, None)),
    ],
)
def test_health_fields_are_read(line: str, expected: tuple[object, ...]) -> None:
    info = parse_gpu_line(line)
    assert (info.ecc_uncorrected, info.retired_pending, info.remapped_pending, info.fault) == (
        expected
    )


def test_a_line_of_the_basic_query_has_no_health_and_a_comma_name_is_not_misread() -> None:
    # Given a driver that refused the health fields (the poll then ran the basic query)
    name = "Tesla V100, SXM2, 16GB, rev 1"
    mark = f"{QUERY_MARK} {BASE_QUERY}"
    result = parse_poll(poll_output([mark, f"0, {U0}, {name}, 16384, 0, 0"], []))
    # Then the line is read as the basic one, its name whole, health unknown
    assert result.error is None
    assert result.gpus[0].name == name and result.gpus[0].ecc_uncorrected is None


@pytest.mark.parametrize(
    "line",
    [
        f"0, {U0}, NVIDIA A100, 1, 0, 0, {2**63}, No, No",
        f"0, {U0}, NVIDIA A100, 1, 0, 0, -1, No, No",
        f"0, {U0}, NVIDIA A100, {2**31}, 0, 0, 0, No, No",
        f"0, {U0}, NVIDIA A100, 1, {'9' * 400}, 0",
    ],
)
def test_a_number_no_column_holds_is_an_unreadable_line(line: str) -> None:
    result = parse_poll(poll_output([line], []))
    assert result.error is not None
    assert "out of range" in result.error or "not a number" in result.error


@pytest.mark.parametrize(
    ("field", "pending"), [("Yes", True), ("No", False), ("2", True), ("0", False), ("maybe", None)]
)
def test_a_pending_field_may_be_a_count_and_an_unknown_form_is_unknown(
    field: str, pending: bool | None
) -> None:
    result = parse_poll(poll_output([f"0, {U0}, NVIDIA A100, 1, 0, 0, 0, No, {field}"], []))
    assert result.error is None and result.gpus[0].remapped_pending is pending


def test_a_faulty_gpu_does_not_make_the_others_unreadable() -> None:
    reset = f"1, {U1}, " + ", ".join(["[GPU requires reset]"] * 7)
    result = parse_poll(poll_output([OK, reset], [f"{U0}, 42, 100"]))
    assert result.error is None
    assert [g.fault for g in result.gpus] == [None, "[GPU requires reset]"]


# -- the simulated nvidia-smi, through the real poll command ---------------------------


def run_poll(tmp_path: Path, config: dict[str, object]) -> list[GpuInfo]:
    sim_gpu.install(tmp_path / "bin", tmp_path / "sim.json", config)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["sh", "-c", poll_command([])], capture_output=True, text=True, env=env, check=True
    ).stdout
    result = parse_poll(out)
    assert result.error is None, result.error
    return list(result.gpus)


def test_the_simulation_reports_each_health_setting(tmp_path: Path) -> None:
    config = sim_gpu.make_config("vm", 6, gpu_name="NVIDIA H100", memory_mb=81559)
    sim_gpu.set_health(config, 1, ecc=3)
    sim_gpu.set_health(config, 2, retired_pending=True, remapped_pending=True)
    sim_gpu.set_health(config, 3, fault="[GPU requires reset]")
    sim_gpu.set_health(config, 4, unsupported=True)
    sim_gpu.set_health(config, 5, vanished=True)
    gpus = run_poll(tmp_path, config)
    assert [(g.index, g.ecc_uncorrected, g.retired_pending, g.remapped_pending, g.fault)
            for g in gpus] == [
        (0, 0, False, False, None),
        (1, 3, False, False, None),
        (2, 0, True, True, None),
        (3, None, None, None, "[GPU requires reset]"),
        (4, None, None, None, None),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown GPU health"):
        sim_gpu.set_health(config, 0, on_fire=True)


def test_a_driver_that_refuses_the_health_fields_still_lists_its_gpus(tmp_path: Path) -> None:
    config = sim_gpu.make_config("vm", 2, gpu_name="Tesla V100, SXM2", memory_mb=16384)
    sim_gpu.set_health(config, 1, ecc=2)
    config["old_driver"] = True
    gpus = run_poll(tmp_path, config)
    assert [(g.index, g.name, g.ecc_uncorrected) for g in gpus] == [
        (0, "Tesla V100, SXM2", None),
        (1, "Tesla V100, SXM2", None),
    ]


def test_a_driver_without_row_remapping_still_reports_ecc_and_retirement(
    tmp_path: Path,
) -> None:
    config = sim_gpu.make_config("vm", 2, gpu_name="Tesla V100, SXM2", memory_mb=16384)
    sim_gpu.set_health(config, 1, ecc=2, retired_pending=True)
    config["old_driver"] = ["remapped_rows.pending"]
    gpus = run_poll(tmp_path, config)
    assert [(g.name, g.ecc_uncorrected, g.retired_pending, g.remapped_pending) for g in gpus] == [
        ("Tesla V100, SXM2", 0, False, None),
        ("Tesla V100, SXM2", 2, True, None),
    ]


def test_an_unknown_query_mark_distrusts_the_answer() -> None:
    result = parse_poll(poll_output([f"{QUERY_MARK} index,pid", f"0, {U0}, A, 1, 0, 0"], []))
    assert result.error is not None and "unknown GPU query" in result.error


# -- health transitions ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("reading", "baseline", "kind"),
    [
        (None, 0, LOST),
        (gpu(fault="[GPU requires reset]"), 0, FAULT),
        (gpu(fault="[Unknown Error]"), 0, FAULT),
        (gpu(ecc_uncorrected=2), 0, ECC),
        (gpu(ecc_uncorrected=2), 2, None),  # not rising
        (gpu(ecc_uncorrected=7), None, None),  # first seen: the baseline, not a rise
        (gpu(ecc_uncorrected=None), 2, None),  # not reported: unknown
        (gpu(retired_pending=True), 0, "retired_pages"),
        (gpu(remapped_pending=True), None, "remapped_rows"),
        (gpu(), None, None),
    ],
)
def test_conditions(reading: GpuInfo | None, baseline: int | None, kind: str | None) -> None:
    found = condition(reading, baseline)
    assert (found.kind if found else None) == kind
    if found is not None:
        assert "\n" not in found.reason and found.reason
        assert found.stops_attempt == (kind in (LOST, FAULT))


def test_rising_ecc_is_unhealthy_at_once_and_healthy_only_after_a_reset_and_clear_polls() -> None:
    # Given a healthy GPU with 1 old uncorrected error
    health = step(Health(), gpu(ecc_uncorrected=1)).health
    assert health == Health(None, 0, 1)
    # When the count rises, it is unhealthy at once, with an event
    s = step(health, gpu(ecc_uncorrected=3))
    assert not s.health.healthy and s.event == "uncorrected ECC errors rose from 1 to 3"
    # While the count stays up, it stays unhealthy (no new event)
    s = step(s.health, gpu(ecc_uncorrected=3))
    assert not s.health.healthy and s.event is None and s.health.clear_polls == 0
    # After a reset (the volatile count back to 0), healthy only after CLEAR_POLLS polls
    for n in range(1, CLEAR_POLLS):
        s = step(s.health, gpu(ecc_uncorrected=0))
        assert not s.health.healthy and s.health.clear_polls == n and s.event is None
    s = step(s.health, gpu(ecc_uncorrected=0))
    assert s.health == Health(None, 0, 0)
    assert s.event is not None and s.event.startswith("healthy again")


def test_a_condition_that_comes_back_while_clearing_starts_the_count_again() -> None:
    s = step(Health(), None)
    assert s.event == "lost: no longer listed by nvidia-smi" and s.condition.stops_attempt
    s = step(s.health, gpu())
    s = step(s.health, gpu(fault="[GPU requires reset]"))
    assert s.health.clear_polls == 0 and s.event is not None and "requires reset" in s.event
    for _ in range(CLEAR_POLLS - 1):
        s = step(s.health, gpu())
        assert not s.health.healthy
    assert step(s.health, gpu()).health.healthy
