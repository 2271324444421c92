"""Reading what a VM printed and the files a job can write on it: never trusted, always
bounded, never raising.

Every file in an attempt directory is the job's to write (docs/invariants.md, invariant 9):
a pid, an exit code or a progress.json is read with a byte bound and parsed here into None
when it is not what it should be. The `rlfleet-exited` line is how the launch and kill
scripts report an exit code they found.
"""

from __future__ import annotations

import re
from typing import Any

EXITED_MARK = "rlfleet-exited"
"""Starts the line on which the launch and kill scripts print an exit code they found."""
_INTEGER = re.compile(r"-?[0-9]+")


def output_lines(stdout: str) -> list[str]:
    """What a VM printed, split at newlines only. `str.splitlines` also splits at `\\r`
    and other breaks a job's log may hold (progress bars), which would let a log line
    pass for one of our marker lines."""
    return stdout.split("\n")


INT_DIGITS = 18
"""Most digits `as_int` reads: a pid, an exit code or a job id; a longer number in a file a
job can write is garbage (and `int` refuses strings of over 4,300 digits anyway)."""


def as_int(text: str) -> int | None:
    """`text` as an integer when it is plain ASCII digits (an optional minus), at most
    `INT_DIGITS` of them; else None. (`str.isdigit` accepts `²` and other digits `int`
    refuses.)"""
    if len(text.lstrip("-")) > INT_DIGITS or not _INTEGER.fullmatch(text):
        return None
    return int(text)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """`text` from a file a job can write, without NUL and other control characters
    (tabs and newlines kept): what may be stored in a reason or shown on a terminal."""
    return _CONTROL.sub("", text)


PID_BYTES = 24
"""At most this much of a `pid` file is read: it holds one number (the job can rewrite it)."""
EXIT_CODE_BYTES = 32
"""At most this much of an `exit_code` file is read."""


def pid_check_lines(variable: str) -> list[str]:
    """Empty `$variable` unless it is a plain pid above 1: the pid file is the job's to
    write, and `kill -0 0`, `kill -TERM -1` or `-5` would reach far more than its attempt."""
    return [f'case "${variable}" in ""|*[!0-9]*|0*|1) {variable}= ;; esac']


def parse_exit(stdout: str) -> int | None:
    """The `rlfleet-exited <code>` a launch or kill script printed, if any."""
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == EXITED_MARK and as_int(parts[1]) is not None:
            return as_int(parts[1])
    return None


NONBLOCK_LINES = [
    "rlfleet_nb=; dd if=/dev/null iflag=nonblock 2>/dev/null && rlfleet_nb=iflag=nonblock"
]
"""Set `$rlfleet_nb` for `head_bytes` and `tail_bytes`: GNU dd's `iflag=nonblock` where the
VM's dd has it, else empty (a plain, blocking read, as `head -c` was)."""


def head_bytes(nbytes: int, path: str) -> str:
    """Shell text printing the first `nbytes` bytes of the file at `path` (a shell word).
    After `NONBLOCK_LINES`, opened non-blocking: a FIFO the job swapped in after the caller's
    `[ -f ]` test holds no read (no writer, or one that writes nothing: nothing is read)."""
    return f"dd if={path} $rlfleet_nb bs={int(nbytes)} count=1 2>/dev/null"


def tail_bytes(nbytes: int, path: str) -> str:
    """Shell text printing the last `nbytes` bytes of the file at `path`, as `head_bytes`
    reads: its size from `ls` (which opens nothing), then at most its last two blocks."""
    n = int(nbytes)
    return (
        f"{{ set -- $(ls -lnLd {path} 2>/dev/null); rlfleet_s=${{5:-0}};"
        ' case "$rlfleet_s" in ""|*[!0-9]*) rlfleet_s=0;; esac;'
        f' rlfleet_k=$((rlfleet_s / {n})); [ "$rlfleet_k" -gt 0 ] && rlfleet_k=$((rlfleet_k - 1));'
        f' dd if={path} $rlfleet_nb bs={n} skip="$rlfleet_k" count=2 2>/dev/null | tail -c {n}; }}'
    )


def read_pid_lines(variable: str = "pid") -> list[str]:
    """Set `$variable` to the attempt's pid (in `$d`), or empty when its pid file holds no
    plausible pid (`pid_check_lines`)."""
    read = head_bytes(PID_BYTES, '"$d/pid"')
    return [
        # One process, as `cat` was (the substitution drops the trailing newline).
        f"{variable}=$({read})",
        *pid_check_lines(variable),
    ]


def load_json(text: str | bytes) -> Any:
    """`text` parsed as JSON, or None when it is not JSON that can be read: invalid
    (UTF-8 included), nested too deep (`RecursionError`), an integer of more digits than
    `int` converts. Never raises: the text comes from a file a job can write, and a bad
    file is that attempt's problem (docs/invariants.md, invariant 9). The caller bounds
    its size."""
    import json

    try:
        return json.loads(text)
    except (ValueError, RecursionError, MemoryError):
        return None
