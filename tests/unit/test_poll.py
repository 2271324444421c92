"""Table tests of the poll parser (real nvidia-smi output formats)."""

from __future__ import annotations

import pytest

from scheduler.nvidia_smi import GpuInfo
from scheduler.poll import APPS, APPS_RC, END, GPUS, GPUS_RC, JOBS, parse_poll
from scheduler.remote.probe import RemoteJobState
from scheduler.states import FailureReason
from scheduler.verdicts import classify_failure

U0 = "GPU-5d2ad6c4-d5a1-8a4b-1b1d-0c4e7c1b8e50"
U1 = "GPU-9e1f0a3b-2c4d-4e5f-8a9b-0c1d2e3f4a5b"
A100 = f"0, {U0}, NVIDIA A100-SXM4-80GB, 81920, 4, 0"
H100 = f"1, {U1}, NVIDIA H100 80GB HBM3, 81559, 70123, 97"
DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
LOST = "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost."


def poll_output(
    gpus: list[str], apps: list[str], *, gpus_rc: int = 0, apps_rc: int = 0, jobs: str = ""
) -> str:
    """What poll_command prints on a VM (the jobs first, then nvidia-smi)."""
    return "\n".join(
        [JOBS, *([jobs] if jobs else [])]
        + [GPUS, *gpus, f"{GPUS_RC} {gpus_rc}", APPS, *apps, f"{APPS_RC} {apps_rc}", END, ""]
    )


def test_two_gpus_one_busy() -> None:
    result = parse_poll(poll_output([A100, H100], [f"{U1}, 4242, 70000"]))
    assert result.error is None
    assert result.gpus == (
        GpuInfo(0, U0, "NVIDIA A100-SXM4-80GB", 81920, 4, 0),
        GpuInfo(1, U1, "NVIDIA H100 80GB HBM3", 81559, 70123, 97),
    )
    assert result.apps[0].pid == 4242
    assert result.busy_uuids() == {U1}


def test_no_compute_apps_means_every_gpu_idle() -> None:
    for apps in ([], ["No running processes found"]):
        result = parse_poll(poll_output([A100, H100], apps))
        assert result.error is None and result.busy_uuids() == set()


@pytest.mark.parametrize("marker", ["[N/A]", "[Not Supported]", "[Insufficient Permissions]"])
def test_unavailable_values_are_unknown_not_errors(marker: str) -> None:
    line = f"0, {U0}, NVIDIA A10G, 23028, {marker}, {marker}"
    app = f"{U0}, 77, {marker}"
    result = parse_poll(poll_output([line], [app]))
    assert result.error is None
    assert result.gpus[0].memory_used_mb is None and result.gpus[0].utilization_pct is None
    assert result.apps[0].used_memory_mb is None
    assert result.busy_uuids() == {U0}


def test_mig_gpu_with_an_app_on_a_mig_instance_blocks_every_gpu() -> None:
    # Given a MIG-enabled A100 (utilization N/A) and a process on a MIG instance
    mig_gpu = f"0, {U0}, NVIDIA A100-SXM4-40GB, 40960, 12, [N/A]"
    app = "MIG-1b2c3d4e-5f60-5a7b-8c9d-0e1f2a3b4c5d, 991, 4864"
    result = parse_poll(poll_output([mig_gpu, H100], [app]))
    # Then it parses, and since the process cannot be placed, no GPU is offered
    assert result.error is None
    assert result.gpus[0].utilization_pct is None
    assert result.busy_uuids() == {U0, U1}


def test_a_gpu_name_with_a_comma_is_rejoined() -> None:
    line = f"0, {U0}, Tesla V100, SXM2, 16384, 0, 0"
    assert parse_poll(poll_output([line], [])).gpus[0].name == "Tesla V100, SXM2"


@pytest.mark.parametrize(
    ("gpus", "gpus_rc", "apps", "apps_rc", "reason"),
    [
        ([DRIVER, ""], 9, [DRIVER], 9, "cannot reach the NVIDIA driver"),
        (["No devices were found"], 6, ["No devices were found"], 6, "no devices were found"),
        ([LOST], 15, [LOST], 15, "fallen off the bus"),
        (["GPU 00000000:3B:00.0: GPU has fallen off the bus."], 0, [], 0, "fallen off the bus"),
        (["sh: 1: nvidia-smi: not found"], 127, [], 127, "not found"),
        ([f"0, {U0}, NVIDIA A1"], 0, [], 0, "unreadable nvidia-smi GPU line 1"),
        ([A100, "\x00\x7f#### ??"], 0, [], 0, "unreadable nvidia-smi GPU line 2"),
        ([f"x, {U0}, NVIDIA A10G, 1, 2, 3"], 0, [], 0, "bad index"),
        ([f"0, {U0}, NVIDIA A10G, lots, 2, 3"], 0, [], 0, "not a number"),
        ([A100, A100], 0, [], 0, "index twice"),
        ([], 0, [], 0, "listed no GPUs"),
        ([A100], 0, [f"{U0}, 12"], 0, "unreadable nvidia-smi process line 1"),
        ([A100], 0, ["Failed to initialize NVML: Unknown Error"], 255, "rc 255"),
    ],
)
def test_failure_modes_become_a_reason(
    gpus: list[str], gpus_rc: int, apps: list[str], apps_rc: int, reason: str
) -> None:
    result = parse_poll(poll_output(gpus, apps, gpus_rc=gpus_rc, apps_rc=apps_rc))
    assert result.error is not None and reason in result.error


def test_a_lost_gpu_beside_listed_ones_is_that_gpu_missing_not_a_broken_vm() -> None:
    # Given nvidia-smi reporting GPU 0 lost (exit 15) and listing GPU 1
    result = parse_poll(
        poll_output([LOST, H100], [LOST, f"{U1}, 4242, 70000"], gpus_rc=15, apps_rc=15)
    )
    # Then the VM's nvidia-smi is trusted, GPU 1 listed (GPU 0 missing: lost, per GPU)
    assert result.error is None
    assert [g.uuid for g in result.gpus] == [U1] and result.busy_uuids() == {U1}
    # And the process listing with nothing but the complaint lists no process
    alone = parse_poll(poll_output([LOST, H100], [LOST], gpus_rc=15, apps_rc=15))
    assert alone.error is None and alone.apps == ()


@pytest.mark.parametrize(
    ("stdout", "reason"),
    [
        ("", "no GPU section"),
        ("garbage\x00\n", "no GPU section"),
        (f"{GPUS}\n{A100}\n", "truncated"),
        (f"{GPUS}\n{A100}\n{GPUS_RC} 0\n", "no process section"),
    ],
)
def test_truncated_output_is_an_error_not_a_crash(stdout: str, reason: str) -> None:
    result = parse_poll(stdout)
    assert result.error is not None and reason in result.error


def test_job_lines_are_read_only_from_a_complete_output() -> None:
    jobs = "rlfleet-job 7 1 exited 75\nrlfleet-log 7 1 CUDA out of memory\n"
    complete = parse_poll(poll_output([A100], [], jobs=jobs))
    assert complete.jobs[(7, 1)] == RemoteJobState("exited", 75, "CUDA out of memory")
    cut = poll_output([A100], [], jobs=jobs).replace(END, "")
    assert parse_poll(cut).jobs == {}
    # Cut short and with nvidia-smi failing too: still no job news from it.
    broken = poll_output(["NVIDIA-SMI has failed"], [], jobs=jobs, gpus_rc=9).replace(END, "")
    result = parse_poll(broken)
    assert result.error is not None and result.jobs == {}
    # Complete, with nvidia-smi failing: the job news stands.
    whole = parse_poll(poll_output(["NVIDIA-SMI has failed"], [], jobs=jobs, gpus_rc=9))
    assert whole.error is not None and (7, 1) in whole.jobs


def test_a_jobs_log_can_neither_forge_job_news_nor_break_the_poll() -> None:
    """Given log lines holding carriage returns (progress bars), other line breaks and
    digits `int` refuses, the poll reads the real status line only, keeps the whole log
    line (so an OOM after a `\\r` still counts) and does not raise."""
    log_lines = [
        "rlfleet-log 7 1 step 3/10\rrlfleet-job 8 1 exited 0",
        "rlfleet-log 7 1 50%|#####\rCUDA out of memory\x0brlfleet-job 9 1 running",
        "rlfleet-log 7 1 \u2028rlfleet-job \u00b2 1 running",
    ]
    jobs = "\n".join(["rlfleet-job 7 1 exited 1", *log_lines, "rlfleet-job 8 1 exited --3"])
    result = parse_poll(poll_output([A100], [], jobs=jobs))
    assert result.error is None
    assert set(result.jobs) == {(7, 1), (8, 1)}
    # The real status line of job 8 holds an exit code no wrapper writes: exited, the
    # job's own failure (`bad_exit_code`), never a code read from the log's forged line.
    assert result.jobs[(8, 1)] == RemoteJobState("exited", None, "", bad_exit_code=True)
    seven = result.jobs[(7, 1)]
    assert (seven.state, seven.exit_code) == ("exited", 1)
    assert "CUDA out of memory" in seven.log_tail
    assert classify_failure(1, seven.log_tail) == FailureReason.OOM
