"""Progress-aware liveness, the pure part (`scheduler.hang`), the GPU load query's parser,
the diagnostics command's answer, and the timeouts a user gives (flags, job-file keys)."""

from __future__ import annotations

import pytest

from scheduler.cli import main
from scheduler.errors import BadInput
from scheduler.hang import Watch, gpus_quiet, stall
from scheduler.jobspec import parse_data
from scheduler.jobstore import JobSpec
from scheduler.nvidia_smi import GpuLoad, parse_loads
from scheduler.poll import parse_poll, poll_command
from scheduler.remote.diagnostics import BEGIN, END, diagnostics_script, parse_diagnostics
from scheduler.remote.layout import Attempt
from scheduler.states import FailureReason
from scheduler.validate import DEFAULT_HANG_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S

GPU = "GPU-aaaaaaaa-0000"
INSTALLATION = "8ecee215-6897-4b04-b858-5f093b6805ac"
IDLE = GpuLoad(0, 60.0, 400.0)
SPINNING = GpuLoad(100, 80.0, 400.0)  # a hung collective: busy at low power
COMPUTING = GpuLoad(100, 300.0, 400.0)


def watch(
    *, step: int | None = 3, unchanged: float | None = 0.0, running: float = 0.0,
    hang: int = 40, startup: int = 600,
) -> Watch:  # fmt: skip
    return Watch(1, 1, hang, startup, running, step, unchanged if step is not None else None)


@pytest.mark.parametrize(
    ("w", "seen", "load", "expected"),
    [
        # Advancing, or not for long enough: left alone.
        (watch(unchanged=39.9), 3, IDLE, None),
        (watch(unchanged=400), 4, IDLE, None),  # the step moved at this poll
        (watch(step=None, running=9999), 0, IDLE, None),  # its first reading: started
        # Unchanged for the timeout with the GPU quiet: hung.
        (watch(unchanged=40), 3, IDLE, FailureReason.HUNG),
        (watch(unchanged=40), 3, SPINNING, FailureReason.HUNG),
        (watch(unchanged=40), None, SPINNING, FailureReason.HUNG),  # unreadable this poll
        # GPUs computing at full power: twice the timeout.
        (watch(unchanged=79), 3, COMPUTING, None),
        (watch(unchanged=80), 3, COMPUTING, FailureReason.HUNG),
        # Turned off.
        (watch(unchanged=10**6, hang=0), 3, IDLE, None),
        # No progress yet: the startup timeout, counted from the launch.
        (watch(step=None, running=599), None, IDLE, None),
        (watch(step=None, running=600), None, COMPUTING, FailureReason.STARTUP_TIMEOUT),
        (watch(step=None, running=10**6, startup=0), None, IDLE, None),
    ],
)
def test_stall(w: Watch, seen: int | None, load: GpuLoad, expected: FailureReason | None) -> None:
    verdict = stall(w, seen, {GPU: load}, [GPU])
    assert (verdict.reason if verdict else None) == expected
    if verdict is not None:
        assert verdict.why.startswith(expected.value + ": ")  # type: ignore[union-attr]


def test_a_hung_reason_says_the_step_the_time_and_the_gpu_signal() -> None:
    verdict = stall(watch(unchanged=41.2), 3, {GPU: SPINNING}, [GPU])
    assert verdict is not None
    assert verdict.why == (
        "hung: step 3 unchanged for 41s (--hang-timeout 40s; GPUs 100 % at 80/400 W)"
    )


def test_gpus_are_quiet_only_if_none_computes_at_full_power() -> None:
    other = "GPU-bbbbbbbb-0000"
    assert gpus_quiet({GPU: IDLE, other: SPINNING}, [GPU, other])
    assert not gpus_quiet({GPU: IDLE, other: COMPUTING}, [GPU, other])
    assert gpus_quiet({}, [GPU])  # no reading: progress alone decides
    assert not gpus_quiet({GPU: GpuLoad(100, None, None)}, [GPU])  # busy, power unknown
    assert gpus_quiet({GPU: GpuLoad(None, None, None)}, [GPU])


def test_parse_loads_reads_what_it_can_and_never_raises() -> None:
    lines = [
        f"{GPU}, 100, 81.52, 400.00",
        "GPU-cccccccc-0000, [N/A], [N/A], [N/A]",
        "GPU-dddddddd-0000, 5 %, 61.00 W, 700.00 W",
        "garbage",
        "GPU-eeeeeeee-0000, 1, 2",
        "\x00\x7f, , , ",
    ]
    assert parse_loads(lines) == {
        GPU: GpuLoad(100, 81.52, 400.0),
        "GPU-cccccccc-0000": GpuLoad(None, None, None),
        "GPU-dddddddd-0000": GpuLoad(5, 61.0, 700.0),
    }


def test_a_poll_asks_for_gpu_loads_only_of_a_vm_running_attempts() -> None:
    run = Attempt(INSTALLATION, 1, 1, "0123456789abcdef")
    assert "power.draw" in poll_command([run]) and "power.draw" not in poll_command([])
    text = "\n".join(
        [
            "@@rlfleet-jobs",
            "@@rlfleet-gpus",
            f"0, {GPU}, H100, 81559, 1024, 100",
            "@@rlfleet-gpus-rc 0",
            "@@rlfleet-apps",
            "@@rlfleet-apps-rc 0",
            "@@rlfleet-loads",
            f"{GPU}, 100, 80.00, 400.00",
            "@@rlfleet-end",
        ]
    )
    assert parse_poll(text).loads == {GPU: SPINNING}
    assert parse_poll(text.replace("@@rlfleet-end", "")).loads == {}  # cut off: not trusted


def test_the_diagnostics_answer_is_read_between_its_marks_and_made_printable() -> None:
    assert parse_diagnostics(f"noise\n{BEGIN}\nstacks\x00\x1b[2J here\n\n{END}\n") == (
        "stacks[2J here\n"
    )
    assert parse_diagnostics(f"{BEGIN}\ncut off") is None
    assert parse_diagnostics("rlfleet-diag-nodir\n") is None


def test_the_diagnostics_command_quotes_what_a_user_chose() -> None:
    run = Attempt(INSTALLATION, 1, 1, "0123456789abcdef")
    script = diagnostics_script(
        run, "/opt/my venv/bin/python; rm -rf ~", "hung: $(reboot)", ["GPU-1;reboot", "GPU-2"]
    )
    assert "'/opt/my venv/bin/python; rm -rf ~'" in script
    assert "'reason: hung: $(reboot)'" in script
    assert "nvidia-smi -i 'GPU-1;reboot,GPU-2' 2>&1" in script


@pytest.mark.parametrize("key", ["hang_timeout", "startup_timeout"])
def test_the_job_file_timeouts(key: str) -> None:
    base = {"roles": {"t": {"gpus": 1, "train": {"model": "m", "dataset": "d",
                                                 "reward_functions": ["format"]}}}}  # fmt: skip
    group = parse_data(base)
    assert (group.hang_timeout_s, group.startup_timeout_s) == (
        DEFAULT_HANG_TIMEOUT_S,
        DEFAULT_STARTUP_TIMEOUT_S,
    )
    assert getattr(parse_data({**base, key: 0}), f"{key}_s") == 0
    assert getattr(parse_data({**base, key: 90}), f"{key}_s") == 90
    for bad in (5, -1, 7 * 86400 + 1, "30m", True, 1.5):
        with pytest.raises(BadInput, match=f"^{key}: must be"):
            parse_data({**base, key: bad})


def test_a_job_spec_checks_its_timeouts() -> None:
    JobSpec("m", "d", ("format",), hang_timeout_s=0, startup_timeout_s=10).validate()
    with pytest.raises(BadInput, match="^--hang-timeout must be 0 .off. or at least 10, not 3$"):
        JobSpec("m", "d", ("format",), hang_timeout_s=3).validate()
    with pytest.raises(BadInput, match="^--startup-timeout must be between 0 and 604800"):
        JobSpec("m", "d", ("format",), startup_timeout_s=10**7).validate()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hang-timeout", "5"], "--hang-timeout must be 0 (off) or at least 10, not 5"),
        (["--startup-timeout", "-1"], "--startup-timeout"),
        (["--hang-timeout", "1h"], "is not a valid integer"),
    ],
)
def test_submit_refuses_a_bad_timeout_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "f", *args]
    with pytest.raises(SystemExit) as exited:
        main(["--database-url", "postgresql://nobody@127.0.0.1:1/none", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
