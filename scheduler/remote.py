"""Shell snippets run on a VM: launch an attempt, kill it, read its log and progress.

Pure functions: they only BUILD POSIX `sh` text. Every value that could come from a user
(model, dataset, reward names, extra args, paths) goes through `shlex.quote` (invariant 5).
Layout on the VM (contract 1): `~/.rlfleet/jobs/<job_id>/<attempt>/` holds `train.log`,
`pid`, `exit_code`, `progress.json` and `launch.sh`; outputs default to
`~/.rlfleet/outputs/<job_id>/`. While an attempt runs, the poller renews its `lease` there
and the attempt's watchdog fences it (stops it and writes `fenced_reason`) when the lease
runs out: see `watchdog_lines`.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.liveness import WATCHDOG_PERIOD_S, Liveness

PID_MARK = "rlfleet-pid"
EXITED_MARK = "rlfleet-exited"
KILL_MARK = "rlfleet-kill"
FENCED_MARK = "rlfleet-fenced"
LEASE_FILE = "lease"
"""Created by every successful poll; the watchdog takes it (renames it `lease.seen`)."""
FENCED_FILE = "fenced_reason"
"""Written by the watchdog when it fenced the attempt off: why, in one line."""
FENCED_REASON_BYTES = 300
DEFAULT_FENCE_AFTER_S = Liveness.fence_after_s
DEFAULT_FENCE_GRACE_S = Liveness.fence_grace_s
_INTEGER = re.compile(r"-?[0-9]+")


def output_lines(stdout: str) -> list[str]:
    """What a VM printed, split at newlines only. `str.splitlines` also splits at `\\r`
    and other breaks a job's log may hold (progress bars), which would let a log line
    pass for one of our marker lines."""
    return stdout.split("\n")


def as_int(text: str) -> int | None:
    """`text` as an integer when it is plain ASCII digits (an optional minus); else None.
    (`str.isdigit` accepts `²` and other digits `int` refuses.)"""
    return int(text) if _INTEGER.fullmatch(text) else None


NO_FILE_EXIT = 3
"""Exit status of the read snippets when the file does not exist (yet)."""
FENCED_EXIT = 96
"""Exit status of the launch script when a kill fenced the attempt off before it started."""
PID_WAIT_S = 10.0
"""How long a launch may take to write its pid, for the launch and the kill scripts."""
DEAD_KILL_OUTCOMES = frozenset({"fenced", "gone", "terminated", "killed"})
"""Kill outcomes after which the attempt surely runs no process and never will."""


def job_dir(job_id: int, attempt: int) -> str:
    """The attempt's directory, relative to $HOME on the VM."""
    return f".rlfleet/jobs/{int(job_id)}/{int(attempt)}"


def default_output_dir(job_id: int) -> str:
    """Where a job's outputs go when it names no `output_dir` (`~` is the VM's $HOME)."""
    return f"~/.rlfleet/outputs/{int(job_id)}"


def home_path(path: str) -> str:
    """A shell word for `path`: `~/x` and relative paths are under $HOME, all quoted."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        path = path[2:]
    if path.startswith("/"):
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path)


def _dir_word(job_id: int, attempt: int) -> str:
    return home_path(job_dir(job_id, attempt))


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launch needs, copied out of the job and VM rows."""

    job_id: int
    attempt: int
    python: str
    entrypoint: str
    gpu_indices: Sequence[int]
    model: str
    dataset: str
    reward_functions: Sequence[str]
    output_dir: str
    extra_args: Sequence[str] = ()
    fence_after_s: float = DEFAULT_FENCE_AFTER_S
    """The watchdog stops the attempt once its lease is this old (0: no watchdog)."""
    fence_grace_s: float = DEFAULT_FENCE_GRACE_S
    """Seconds between the watchdog's TERM and its KILL."""


def entry_words(python: str, entrypoint: str, num_gpus: int) -> list[str]:
    """How training starts on the VM (contract 5), as quoted shell words.

    A `.py` entrypoint runs as a script, anything else as a module; more than one GPU puts
    `accelerate launch --num_processes N` in front.
    """
    words = [shlex.quote(python)]
    if num_gpus > 1:
        words += ["-m", "accelerate.commands.launch", "--num_processes", str(int(num_gpus))]
    if entrypoint.endswith(".py"):
        words.append(shlex.quote(entrypoint))
    else:
        words += ["-m", shlex.quote(entrypoint)]
    return words


def train_words(spec: LaunchSpec) -> list[str]:
    """The full, quoted training command of one attempt."""
    words = entry_words(spec.python, spec.entrypoint, len(spec.gpu_indices))
    words += ["--model", shlex.quote(spec.model), "--dataset", shlex.quote(spec.dataset)]
    for reward in spec.reward_functions:
        words += ["--reward_function", shlex.quote(reward)]
    words += ["--output_dir", home_path(spec.output_dir)]
    words += [shlex.quote(arg) for arg in spec.extra_args]
    if spec.attempt > 1:
        words += ["--resume", "auto"]
    return words


def wrapper_script(spec: LaunchSpec) -> str:
    """`launch.sh`: records its pid, runs training in the foreground, records the exit code.

    It runs as the leader of its own session (setsid), so its pid is the process group the
    kill script signals. The traps keep the wrapper alive long enough to write `exit_code`
    when the group is sent TERM/INT/HUP; the training process itself still gets the default
    action because a trapped (not ignored) signal is reset on exec. A watchdog runs beside
    the training (`watchdog_lines`) and is stopped the moment the training ends.
    """
    d = _dir_word(spec.job_id, spec.attempt)
    gpus = ",".join(str(int(i)) for i in spec.gpu_indices)
    return "\n".join(
        [
            "#!/bin/sh",
            f"# rlfleet job {int(spec.job_id)} attempt {int(spec.attempt)}",
            f"d={d}",
            'echo "$$" > "$d/pid.tmp" && mv -f "$d/pid.tmp" "$d/pid"',
            "trap 'rlfleet_sig=TERM' TERM",
            "trap 'rlfleet_sig=INT' INT",
            "trap 'rlfleet_sig=HUP' HUP",
            *watchdog_lines(spec.fence_after_s, spec.fence_grace_s),
            'cd "$HOME" || exit 1',
            f"export CUDA_VISIBLE_DEVICES={shlex.quote(gpus)}",
            'export RLFLEET_PROGRESS_FILE="$d/progress.json"',
            f"export RLFLEET_JOB_ID={int(spec.job_id)} RLFLEET_ATTEMPT={int(spec.attempt)}",
            f"mkdir -p {home_path(spec.output_dir)}",
            'echo "rlfleet: attempt started on $(hostname) at $(date -u +%FT%TZ)'
            ' CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"',
            " ".join(train_words(spec)),
            "rc=$?",
            *watchdog_stop_lines(),
            'echo "$rc" > "$d/exit_code.tmp" && mv -f "$d/exit_code.tmp" "$d/exit_code"',
            'echo "rlfleet: attempt ended with exit code $rc"',
            "",
        ]
    )


def watchdog_lines(fence_after_s: float, grace_s: float) -> list[str]:
    """Start the attempt's watchdog in the background (POSIX sh, run by the wrapper).

    Every `WATCHDOG_PERIOD_S` it takes the lease file the poller creates on each successful
    poll (`lease_touch_lines`); when none came for `fence_after_s` seconds by this VM's own
    clock (/proc/uptime, which no clock step moves; `date +%s` where there is none), the
    scheduler has lost contact and may already have given the job to another VM. It then
    fences the attempt: writes `fenced_reason`, logs a line to train.log, sends TERM to the
    attempt's process group, and KILL after `grace_s` if the training is still running
    (writing exit code 137, as the kill script does). It ignores the group's TERM, leaves
    when the wrapper is gone, and `watchdog_stop_lines` ends it with the training; it costs
    one `sleep` a second. `fence_after_s <= 0` starts no watchdog.
    """
    if fence_after_s <= 0:
        return ["rlfleet_wd="]
    after = max(1, math.ceil(fence_after_s))
    grace = max(0, math.ceil(grace_s))
    period = int(WATCHDOG_PERIOD_S)
    return [
        "if [ -r /proc/uptime ]; then rlfleet_now() { read -r t _ </proc/uptime; t=${t%%.*}; }",
        "else rlfleet_now() { t=$(date +%s); }; fi",
        "(",
        "  trap '' TERM INT HUP",
        '  trap \'kill -KILL "$s" 2>/dev/null; wait "$s"; exit 0\' USR1',
        "  w=$$; s=; rlfleet_now; seen=$t",
        "  while :; do",
        f'    sleep {period} & s=$!; wait "$s"',
        '    if [ -s "$d/exit_code" ] || ! kill -0 "$w" 2>/dev/null; then exit 0; fi',
        "    rlfleet_now",
        f'    if [ -e "$d/{LEASE_FILE}" ]; then',
        f'      mv -f "$d/{LEASE_FILE}" "$d/{LEASE_FILE}.seen" 2>/dev/null; seen=$t',
        f"    elif [ $((t - seen)) -ge {after} ]; then break; fi",
        "  done",
        f'  why="lease not renewed for $((t - seen))s (fence after {after}s):'
        ' the scheduler lost contact with this VM"',
        f'  printf "%s\\n" "$why" > "$d/{FENCED_FILE}.tmp"'
        f' && mv -f "$d/{FENCED_FILE}.tmp" "$d/{FENCED_FILE}"',
        f'  echo "rlfleet: fenced: $why; stopping the attempt (TERM, KILL after {grace}s)"',
        '  kill -TERM -"$w" 2>/dev/null',
        "  n=0",
        f'  while [ "$n" -lt {grace} ]; do',
        f'    sleep {period} & s=$!; wait "$s"',
        '    if [ -s "$d/exit_code" ] || ! kill -0 "$w" 2>/dev/null; then exit 0; fi',
        f"    n=$((n + {period}))",
        "  done",
        f'  echo "rlfleet: fenced: still running {grace}s after TERM: KILL"',
        '  [ -e "$d/exit_code" ] || echo 137 > "$d/exit_code"',
        '  kill -KILL -"$w" 2>/dev/null',
        ") 2>/dev/null &",  # its messages go to stdout (train.log); the shell's own, nowhere
        "rlfleet_wd=$!",
    ]


def watchdog_stop_lines() -> list[str]:
    """End the watchdog at once (the training it guards has ended) and reap it, so not
    even a zombie of it outlives the attempt."""
    return ['[ -z "$rlfleet_wd" ] || { kill -USR1 "$rlfleet_wd" 2>/dev/null; wait "$rlfleet_wd"; }']


def lease_touch_lines() -> list[str]:
    """Renew the lease of the attempt in `$d` (run by each poll): the attempt's watchdog
    sees that the scheduler still reaches this VM. Creates nothing else."""
    return [f'if [ -d "$d" ]; then : 2>/dev/null > "$d/{LEASE_FILE}"; fi']


def fenced_lines(job_id: int, attempt: int) -> list[str]:
    """Print `rlfleet-fenced <id> <attempt> <why>` if the attempt in `$d` was fenced."""
    j, a = int(job_id), int(attempt)
    return [
        f'if [ -s "$d/{FENCED_FILE}" ]; then echo "{FENCED_MARK} {j} {a}'
        f' $(head -c {FENCED_REASON_BYTES} "$d/{FENCED_FILE}" | tr -d "\\n")"; fi'
    ]


def fenced_script(job_id: int, attempt: int) -> str:
    """Shell text printing the `rlfleet-fenced` line of one attempt, if it was fenced."""
    return "\n".join([f"d={_dir_word(job_id, attempt)}", *fenced_lines(job_id, attempt), ""])


def parse_fenced(stdout: str) -> dict[tuple[int, int], str]:
    """The `rlfleet-fenced` lines of an output: why each fenced attempt was fenced."""
    out: dict[tuple[int, int], str] = {}
    for line in output_lines(stdout):
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == FENCED_MARK:
            job_id, attempt = as_int(parts[1]), as_int(parts[2])
            if job_id is not None and attempt is not None:
                out[(job_id, attempt)] = (parts[3] if len(parts) == 4 else "").strip()
    return out


def launch_script(spec: LaunchSpec, *, pid_wait_s: float = PID_WAIT_S) -> str:
    """Start the attempt detached from the SSH session and print `rlfleet-pid <pid>`.

    Idempotent per attempt directory: `mkdir` of a lock directory is atomic, so only the
    first launch starts a process; a repeated launch waits for that one's pid file and
    reports the same pid. Prints `rlfleet-exited <code>` too when the attempt already ended.
    A kill that came first took the lock and left a `fenced` mark (see `kill_script`):
    then nothing starts and the script exits `FENCED_EXIT`.
    """
    d = _dir_word(spec.job_id, spec.attempt)
    polls = max(1, int(pid_wait_s / 0.05))
    return "\n".join(
        [
            f"d={d}",
            'mkdir -p "$d" || exit 97',
            'if mkdir "$d/.launch.lock" 2>/dev/null; then',
            f'  printf "%s" {shlex.quote(wrapper_script(spec))} > "$d/launch.sh" || exit 97',
            '  setsid sh "$d/launch.sh" </dev/null >>"$d/train.log" 2>&1 &',
            "fi",
            "n=0",
            'while [ ! -s "$d/pid" ]; do',
            '  if [ -e "$d/fenced" ]; then',
            f'    echo "rlfleet: attempt was killed before it started" >&2; exit {FENCED_EXIT}',
            "  fi",
            "  n=$((n + 1))",
            f'  if [ "$n" -gt {polls} ]; then echo "rlfleet: no pid file after launch" >&2;'
            " exit 98; fi",
            "  sleep 0.05",
            "done",
            f'echo "{PID_MARK} $(cat "$d/pid")"',
            f'if [ -s "$d/exit_code" ]; then echo "{EXITED_MARK} $(cat "$d/exit_code")"; fi',
            "",
        ]
    )


@dataclass(frozen=True)
class LaunchResult:
    """What the launch script reported: the pid, and the exit code if it already ended."""

    pid: int
    exit_code: int | None = None


def parse_launch(stdout: str) -> LaunchResult | None:
    """Read the launch script's output; None when it printed no pid."""
    pid: int | None = None
    exit_code: int | None = None
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == PID_MARK and as_int(parts[1]) is not None:
            pid = as_int(parts[1])
        elif len(parts) == 2 and parts[0] == EXITED_MARK and as_int(parts[1]) is not None:
            exit_code = as_int(parts[1])
    return None if pid is None else LaunchResult(pid, exit_code)


def kill_script(
    job_id: int, attempt: int, grace_s: float = 10.0, *, pid_wait_s: float = PID_WAIT_S
) -> str:
    """TERM the attempt's process group, KILL it after `grace_s`; idempotent.

    Prints `rlfleet-kill <outcome>`: `fenced` (never started, and now never will: the kill
    took the launch lock first, so a launch still on its way finds it and starts nothing),
    `gone` (nothing left to signal), `terminated` (ended within the grace period),
    `killed`, or `nopid` (a launch holds the lock but wrote no pid within `pid_wait_s`:
    its fate is unknown). After a KILL the wrapper cannot record an exit code, so the
    script writes 137 (128 + SIGKILL) for it.
    """
    d = _dir_word(job_id, attempt)
    polls = max(1, int(grace_s / 0.1))
    pid_polls = max(1, int(pid_wait_s / 0.05))
    return "\n".join(
        [
            f"d={d}",
            'if [ ! -s "$d/pid" ]; then',
            f'  if [ -e "$d/fenced" ]; then echo "{KILL_MARK} fenced"; exit 0; fi',
            '  mkdir -p "$d" 2>/dev/null',
            '  if mkdir "$d/.launch.lock" 2>/dev/null; then',
            f'    : > "$d/fenced"; echo "{KILL_MARK} fenced"; exit 0',
            "  fi",
            # A launch holds the lock: its wrapper writes the pid first thing.
            "  n=0",
            '  while [ ! -s "$d/pid" ]; do',
            "    n=$((n + 1))",
            f'    if [ "$n" -gt {pid_polls} ]; then echo "{KILL_MARK} nopid"; exit 0; fi',
            "    sleep 0.05",
            "  done",
            "fi",
            # The attempt ended: its pid may belong to someone else by now.
            f'if [ -s "$d/exit_code" ]; then echo "{KILL_MARK} gone"; exit 0; fi',
            'pid=$(cat "$d/pid")',
            f'kill -TERM -"$pid" 2>/dev/null || {{ echo "{KILL_MARK} gone"; exit 0; }}',
            "n=0",
            'while kill -0 -"$pid" 2>/dev/null; do',
            "  n=$((n + 1))",
            f'  if [ "$n" -gt {polls} ]; then',
            '    kill -KILL -"$pid" 2>/dev/null',
            '    [ -e "$d/exit_code" ] || echo 137 > "$d/exit_code"',
            f'    echo "{KILL_MARK} killed"; exit 0',
            "  fi",
            "  sleep 0.1",
            "done",
            f'echo "{KILL_MARK} terminated"',
            "",
        ]
    )


def parse_kill(stdout: str) -> str | None:
    """The kill script's outcome word, or None if it printed none."""
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == KILL_MARK:
            return parts[1]
    return None


def read_file_script(job_id: int, attempt: int, name: str, *, offset: int = 0) -> str:
    """Print one file of the attempt directory from byte `offset`; exit 3 if it is missing."""
    if name not in {"train.log", "progress.json", "pid", "exit_code", "launch.sh"}:
        raise ValueError(f"not an attempt file: {name}")
    d = _dir_word(job_id, attempt)
    return f'f={d}/{name}; [ -f "$f" ] || exit {NO_FILE_EXIT}; tail -c +{int(offset) + 1} "$f"'


# --- job status probe (contract 2), run by the poller in the same round trip as nvidia-smi

STATUS_MARK = "rlfleet-job"
LOG_MARK = "rlfleet-log"
JOB_STATES = ("running", "exited", "vanished", "unknown")
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 4096


@dataclass(frozen=True)
class RemoteJobState:
    """What the status probe saw of one attempt on its VM.

    `state`: `running` (the pid answers), `exited` (`exit_code` written), `vanished` (a pid
    file but no process and no exit code: killed with the wrapper, or the VM rebooted) or
    `unknown` (no pid file: not launched yet, or the directory is gone).
    """

    state: str
    exit_code: int | None = None
    log_tail: str = ""
    fenced: str | None = None
    """Why the attempt's watchdog fenced it off, if it did."""


def status_probe(jobs: Sequence[tuple[int, int]]) -> str:
    """Shell text printing one `rlfleet-job <id> <attempt> <state> [code]` line per attempt.

    An exited attempt is followed by the last lines of its train.log, each prefixed with
    `rlfleet-log <id> <attempt> `. Each probe renews the attempt's lease, and reports a
    fenced attempt with a `rlfleet-fenced` line. exit_code is checked before and after the
    liveness test because the wrapper writes it just before it exits.
    """
    lines = []
    for job_id, attempt in jobs:
        j, a = int(job_id), int(attempt)
        lines += [f"d={_dir_word(j, a)}", *lease_touch_lines(), *fenced_lines(j, a)]
        lines += [
            'if [ -s "$d/exit_code" ]; then s=exited',
            'elif [ -s "$d/pid" ] && p=$(cat "$d/pid") && kill -0 "$p" 2>/dev/null'
            # A zombie answers kill -0 but is dead (its reaper may be slow or absent).
            " && ! { [ -r /proc/$p/stat ] && cut -d')' -f2- /proc/$p/stat | grep -q '^ Z'; };"
            " then s=running",
            'elif [ -s "$d/exit_code" ]; then s=exited',
            'elif [ -s "$d/pid" ]; then s=vanished',
            "else s=unknown; fi",
            'if [ "$s" = exited ]; then',
            f'  echo "{STATUS_MARK} {j} {a} exited $(head -c 32 "$d/exit_code" | tr -d "\\n")"',
            f'  tail -n {LOG_TAIL_LINES} "$d/train.log" 2>/dev/null | tail -c {LOG_TAIL_BYTES}'
            f' | sed "s/^/{LOG_MARK} {j} {a} /"',
            "  echo",
            f'else echo "{STATUS_MARK} {j} {a} $s"; fi',
        ]
    return "\n".join(lines) + "\n"


def parse_status(stdout: str) -> dict[tuple[int, int], RemoteJobState]:
    """Read `status_probe` output; an unreadable line for an attempt makes it `unknown`."""
    states: dict[tuple[int, int], tuple[str, int | None]] = {}
    logs: dict[tuple[int, int], list[str]] = {}
    for line in output_lines(stdout):
        if line.startswith(LOG_MARK + " "):
            parts = line.split(" ", 3)
            job_id, attempt = (as_int(p) for p in parts[1:3]) if len(parts) >= 3 else (None, None)
            if job_id is not None and attempt is not None:
                logs.setdefault((job_id, attempt), []).append(parts[3] if len(parts) == 4 else "")
            continue
        parts = line.split()
        if len(parts) < 4 or parts[0] != STATUS_MARK or parts[3] not in JOB_STATES:
            continue
        job_id, attempt = as_int(parts[1]), as_int(parts[2])
        if job_id is None or attempt is None:
            continue
        if parts[3] == "exited":
            code = as_int(parts[4]) if len(parts) == 5 else None
            states[(job_id, attempt)] = ("exited", code) if code is not None else ("unknown", None)
        else:
            states[(job_id, attempt)] = (parts[3], None)
    fenced = parse_fenced(stdout)
    return {
        key: RemoteJobState(state, code, "\n".join(logs.get(key, [])), fenced.get(key))
        for key, (state, code) in states.items()
    }
