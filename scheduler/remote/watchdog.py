"""An attempt's watchdog and its lease: while an attempt runs, the poller renews its
`lease` file and the watchdog beside the training fences the attempt (stops it and writes
`fenced_reason`) when the lease runs out: see `watchdog_lines`.
"""

from __future__ import annotations

import math
import re

from scheduler.liveness import WATCHDOG_PERIOD_S, Liveness
from scheduler.remote.jobuser import group_signal
from scheduler.remote.kill import marked_kill_lines
from scheduler.remote.layout import Attempt
from scheduler.remote.output import as_int, head_bytes, output_lines, printable

FENCED_MARK = "rlfleet-fenced"
LEASE_FILE = "lease"
"""Created by every successful poll; the watchdog takes it (renames it `lease.seen`)."""
FENCED_FILE = "fenced_reason"
"""Written by the watchdog when it fenced the attempt off: why, in one line."""
FENCED_REASON_BYTES = 300
_FENCE_NOTE = re.compile(
    r"lease not renewed for ([0-9]{1,9})s \(fence after ([0-9]{1,9})s\):"
    r" the scheduler lost contact with this VM"
)
"""The one line a watchdog writes into `fenced_reason` (`watchdog_lines`, `fence_note`)."""
DEFAULT_FENCE_AFTER_S = Liveness.fence_after_s
DEFAULT_FENCE_GRACE_S = Liveness.fence_grace_s


def watchdog_lines(
    fence_after_s: float,
    grace_s: float,
    run: Attempt | None = None,
    job_user: str | None = None,
) -> list[str]:
    """Start the attempt's watchdog in the background (POSIX sh, run by the wrapper).

    Every `WATCHDOG_PERIOD_S` it takes the lease file the poller creates on each successful
    poll (`lease_touch_lines`); when none came for `fence_after_s` seconds by this VM's own
    clock (/proc/uptime, which no clock step moves; `date +%s` where there is none), the
    scheduler has lost contact and may already have given the job to another VM. It then
    fences the attempt: writes `fenced_reason`, logs a line to train.log, sends TERM to the
    attempt's process group, and KILL after `grace_s` if the training is still running
    (writing exit code 137, as the kill script does). It ignores the group's TERM, leaves
    when the wrapper is gone, and `watchdog_stop_lines` ends it with the training; it costs
    one `sleep` a second. `fence_after_s <= 0` starts no watchdog. With `run`, the fence
    also stops what the job started outside its process group (`marked_kill_lines`): TERM
    with the group, KILL once the group has ended or its grace has passed; and, in a
    wrapper that made the attempt's cgroup (`$rlfleet_cg`, `remote.cgroup`), everything in
    it: TERM with the group, the whole cgroup killed and removed once the wrapper is gone.
    With a `job_user`, every signal is sent as J too (`scheduler.remote.jobuser`).
    """
    if fence_after_s <= 0:
        return ["rlfleet_wd="]
    after = max(1, math.ceil(fence_after_s))
    grace = max(0, math.ceil(grace_s))
    period = int(WATCHDOG_PERIOD_S)
    term, kill9 = (group_signal(s, '"$w"', job_user) for s in ("TERM", "KILL"))
    # With `all` (the wrapper is gone or being killed): the attempt's cgroup first, whole
    # (`remote.cgroup`: the wrapper and all in it at once; the wrapper's own pass at its
    # end does it otherwise), then what carries the marker.
    leftovers = ['  if [ -n "${1:-}" ] && [ -n "${rlfleet_cg:-}" ]; then rlfleet_cg_kill; fi']
    leftovers += (
        marked_kill_lines(run, "KILL", "  ", job_user=job_user) if run is not None else ["  :"]
    )
    return [
        "if [ -r /proc/uptime ]; then rlfleet_now() { read -r t _ </proc/uptime; t=${t%%.*}; }",
        "else rlfleet_now() { t=$(date +%s); }; fi",
        # What the job started outside its process group, killed once a fence is under way.
        "rlfleet_leftovers() {",
        *leftovers,
        "}",
        "(",
        "  trap '' TERM INT HUP",
        '  trap \'kill -KILL "$s" 2>/dev/null; wait "$s"; [ -z "$f" ] || rlfleet_leftovers;'
        " exit 0' USR1",
        "  w=$$; s=; f=; rlfleet_now; seen=$t",
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
        f"  f=1; {term}",
        *(
            marked_kill_lines(run, "TERM", "  ", outside='"$w"', job_user=job_user)
            if run is not None
            else []
        ),
        '  [ -z "${rlfleet_cg:-}" ] || rlfleet_cg_signal TERM',
        "  n=0",
        f'  while [ "$n" -lt {grace} ]; do',
        f'    sleep {period} & s=$!; wait "$s"',
        '    if [ -s "$d/exit_code" ] || ! kill -0 "$w" 2>/dev/null; then'
        " trap '' USR1; rlfleet_leftovers all; exit 0; fi",
        f"    n=$((n + {period}))",
        "  done",
        f'  echo "rlfleet: fenced: still running {grace}s after TERM: KILL"',
        '  [ -e "$d/exit_code" ] || echo 137 > "$d/exit_code"',
        # The leftovers first: the group's KILL is this watchdog's end too (it is in it).
        # No USR1 from here (a wrapper that saw its training die): the stop is finished.
        "  trap '' USR1; rlfleet_leftovers all",
        f"  {kill9}",
        ") 2>/dev/null &",  # its messages go to stdout (train.log); the shell's own, nowhere
        "rlfleet_wd=$!",
    ]


def fence_note(silent_s: int, after_s: int) -> str:
    """What a watchdog writes into `fenced_reason` after `silent_s` seconds without a lease
    (`after_s`: its fence-after setting); the shell text above prints the same line."""
    return (
        f"lease not renewed for {int(silent_s)}s (fence after {int(after_s)}s):"
        " the scheduler lost contact with this VM"
    )


def is_fence_note(text: str) -> bool:
    """Whether `text` (a `fenced_reason` as the probe read it) is a line a watchdog writes:
    the file is in a directory the job can write, and anything else in it is the job's
    (docs/invariants.md, invariant 9), never a lost node."""
    match = _FENCE_NOTE.fullmatch(text)
    return match is not None and int(match.group(1)) >= int(match.group(2)) >= 1


def watchdog_stop_lines() -> list[str]:
    """End the watchdog at once (the training it guards has ended) and reap it, so not
    even a zombie of it outlives the attempt."""
    return ['[ -z "$rlfleet_wd" ] || { kill -USR1 "$rlfleet_wd" 2>/dev/null; wait "$rlfleet_wd"; }']


def lease_touch_lines() -> list[str]:
    """Renew the lease of the attempt in `$d` (run by each poll): the attempt's watchdog
    sees that the scheduler still reaches this VM. Creates nothing else."""
    # `<>` opens read-write: it creates the file, truncates nothing, and does not wait for
    # a reader when a job made the lease a FIFO.
    return [f'if [ -d "$d" ]; then : 2>/dev/null <>"$d/{LEASE_FILE}"; fi']


def fenced_lines(job_id: int, attempt: int) -> list[str]:
    """Print `rlfleet-fenced <id> <attempt> <why>` if the attempt in `$d` was fenced."""
    j, a = int(job_id), int(attempt)
    read = head_bytes(FENCED_REASON_BYTES, f'"$d/{FENCED_FILE}"')
    return [
        f'if [ -f "$d/{FENCED_FILE}" ] && [ -s "$d/{FENCED_FILE}" ]; then'
        f' echo "{FENCED_MARK} {j} {a}'
        f' $({read} | tr -d "\\n")"; fi'
    ]


def fenced_script(run: Attempt) -> str:
    """Shell text printing the `rlfleet-fenced` line of one attempt, if it was fenced."""
    return "\n".join([f"d={run.word()}", *fenced_lines(run.job_id, run.attempt), ""])


def parse_fenced(stdout: str) -> dict[tuple[int, int], str]:
    """The `rlfleet-fenced` lines of an output: why each fenced attempt was fenced."""
    out: dict[tuple[int, int], str] = {}
    for line in output_lines(stdout):
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == FENCED_MARK:
            job_id, attempt = as_int(parts[1]), as_int(parts[2])
            if job_id is not None and attempt is not None:
                out[(job_id, attempt)] = printable(parts[3] if len(parts) == 4 else "").strip()
    return out
