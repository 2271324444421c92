"""The attempt status probe (docs/invariants.md, contract 2), run by the poller in the
same round trip as nvidia-smi (`scheduler.poll`): whether each attempt runs, its exit code,
the end of its log and its progress.json, every file read with a byte bound and parsed
without trusting it (docs/invariants.md, invariant 9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.redact import scrub_urls
from scheduler.remote.kill import wrapper_alive
from scheduler.remote.launch import CANNOT_START_FILE, CANNOT_START_MARK
from scheduler.remote.layout import Attempt
from scheduler.remote.output import (
    EXIT_CODE_BYTES,
    as_int,
    head_bytes,
    load_json,
    output_lines,
    printable,
    read_pid_lines,
    tail_bytes,
)
from scheduler.remote.restarts import restart_lines
from scheduler.remote.store import (
    STORE_ERROR_FILE,
    STORE_ERROR_MARK,
    STORE_MARK,
    STORE_STATUS_BYTES,
    STORE_STATUS_FILE,
)
from scheduler.remote.watchdog import fenced_lines, lease_touch_lines, parse_fenced
from scheduler.store.binding import reported

STATUS_MARK = "rlfleet-job"
LOG_MARK = "rlfleet-log"
PROGRESS_MARK = "rlfleet-progress"
PROGRESS_BYTES = 2048
"""At most this much of an attempt's progress.json is read by a poll (it is a few hundred
bytes; a bigger one is cut and then ignored as unreadable)."""
JOB_STATES = ("running", "exited", "vanished", "unknown")
MAX_EXIT_CODE = 255
"""The largest exit code a wrapper records (`$?`); anything else in `exit_code` is garbage."""
LOG_TAIL_LINES = 20
"""At most this many lines of an exited attempt's log are kept (from its last bytes)."""
LOG_TAIL_BYTES = 4096
"""At most this many bytes from the end of an exited attempt's log are read."""


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
    progress: ProgressPoint | None = None
    """The attempt's progress.json as this poll read it; None: none, or unreadable."""
    cannot_start: bool = False
    """The wrapper's own check of the VM's python and entrypoint failed
    (`CANNOT_START_FILE`): the exit code is the VM's fault, not the job's."""
    store_error: bool = False
    """The wrapper could not use the job's store (`STORE_ERROR_FILE`)."""
    store: dict[str, object] | None = None
    """The attempt's store status (`parse_store_status`); None: none, or unreadable."""
    bad_exit_code: bool = False
    """`exited` with an `exit_code` file that holds no exit code a wrapper writes (0-255):
    the job's doing (`verdicts.job_verdict` fails it, counted)."""
    store_digests: tuple[tuple[str, int, str], ...] = ()
    """The manifests its store agent reported writing, (kind, step, digest), checked
    (`scheduler.store.binding.reported`): recorded in Postgres by the poller."""


@dataclass(frozen=True)
class ProgressPoint:
    """The training step an attempt has reached, with its reward and loss (for the curves)."""

    step: int
    reward: float | None = None
    loss: float | None = None


def parse_progress(text: str) -> ProgressPoint | None:
    """A progress.json's step, reward and loss; None for anything that is not such a file
    (half-written, cut, a step that is not a whole number, values that are not finite)."""
    data = load_json(text)
    if not isinstance(data, dict):
        return None
    step = data.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**31:
        return None

    def number(key: str) -> float | None:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if math.isfinite(value) else None

    return ProgressPoint(step, number("reward"), number("loss"))


def parse_store_status(text: str) -> dict[str, object] | None:
    """An attempt's store.json, as the agent writes it, checked field by field (the file
    is in a directory the job can write): the store URL, the checkpoints in the store
    (step, bytes, time; at most 6), the restored step, whether the final outputs are
    in, the last error. None for anything else."""
    data = load_json(text)
    if not isinstance(data, dict):
        return None

    def short(value: object, size: int) -> str | None:
        # A URL in an error may carry credentials (`AWS_ENDPOINT_URL=https://u:p@host`).
        return scrub_urls(printable(value))[:size] if isinstance(value, str) and value else None

    def count(value: object) -> int | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53
        return value if ok else None  # type: ignore[return-value]

    checkpoints = []
    raw = data.get("checkpoints")
    for item in raw[-6:] if isinstance(raw, list) else []:
        if isinstance(item, dict) and count(item.get("step")) is not None:
            checkpoints.append(
                {
                    "step": count(item.get("step")),
                    "bytes": count(item.get("bytes")),
                    "at": short(item.get("at"), 40),
                }
            )
    return {
        "checkpoints": checkpoints,
        "restored": count(data.get("restored")),
        "final": data.get("final") is True,
        "last_error": short(data.get("last_error"), 300),
        "error_at": short(data.get("error_at"), 40),
    }


def status_probe(jobs: Sequence[Attempt]) -> str:
    """Shell text printing one `rlfleet-job <id> <attempt> <state> [code]` line per attempt.

    An exited attempt is followed by the end of its train.log (its last `LOG_TAIL_BYTES`),
    each line prefixed with `rlfleet-log <id> <attempt> `, and by a `rlfleet-cannot-start`
    line when the wrapper's own check failed. Each probe renews the attempt's lease, and
    reports a fenced attempt with a `rlfleet-fenced` line.

    Every file here is the job's to write (docs/invariants.md, invariant 9), so each is
    read with a byte bound (`output.head_bytes`, `tail_bytes`: a sparse 10 GB log without
    newlines costs what 4 KB does), only when it is a regular file, and opened non-blocking
    where the VM's dd can (`output.NONBLOCK_LINES`: a FIFO swapped in after the test holds
    no read), and nothing in them is trusted: the attempt runs while its wrapper (the pid
    in `pid`, a live process whose command line is this attempt's `launch.sh`) runs, whatever
    `exit_code` says, so an exit code written by someone else beside a live wrapper is
    not taken. Only once the wrapper is gone is `exit_code` read; the wrapper writes it
    just before it exits, so it is there by then. A job group's `roles.json` (its restarts
    in place) is printed on one line too (`remote.restarts`).
    """
    read_code = head_bytes(EXIT_CODE_BYTES, '"$d/exit_code"')
    read_log = tail_bytes(LOG_TAIL_BYTES, '"$d/train.log"')
    read_progress = head_bytes(PROGRESS_BYTES, '"$d/progress.json"')
    read_store = head_bytes(STORE_STATUS_BYTES, f'"$d/{STORE_STATUS_FILE}"')
    lines = []
    for run in jobs:
        j, a = int(run.job_id), int(run.attempt)
        lines += [f"d={run.word()}", *lease_touch_lines(), *fenced_lines(j, a)]
        lines += [
            "s=unknown; p=",
            'if [ -f "$d/pid" ] && [ -s "$d/pid" ]; then',
            *("  " + line for line in read_pid_lines("p")),
            "fi",
            'if [ -n "$p" ] && kill -0 "$p" 2>/dev/null'
            # A zombie answers kill -0 but is dead (its reaper may be slow or absent).
            " && ! { [ -r /proc/$p/stat ] && cut -d')' -f2- /proc/$p/stat | grep -q '^ Z'; };"
            " then",
            # Alive; with an exit code beside it, only the wrapper itself counts as running
            # (its pid may have been reused since it ended).
            f'  if [ -s "$d/exit_code" ] && ! {{ {wrapper_alive(run, "$p")}; }};'
            " then s=exited; else s=running; fi",
            'elif [ -f "$d/exit_code" ] && [ -s "$d/exit_code" ]; then s=exited',
            'elif [ -e "$d/pid" ]; then s=vanished',
            "fi",
            'if [ "$s" = exited ]; then',
            f'  echo "{STATUS_MARK} {j} {a} exited $({read_code} | tr -d "\\n")"',
            f'  if [ -e "$d/{CANNOT_START_FILE}" ]; then echo "{CANNOT_START_MARK} {j} {a}"; fi',
            f'  if [ -e "$d/{STORE_ERROR_FILE}" ]; then echo "{STORE_ERROR_MARK} {j} {a}"; fi',
            f'  if [ -f "$d/train.log" ]; then {read_log} | sed "s/^/{LOG_MARK} {j} {a} /"; fi',
            "  echo",
            f'else echo "{STATUS_MARK} {j} {a} $s"; fi',
            # One line: the JSON's own newlines are only whitespace between its tokens.
            f'if [ -f "$d/progress.json" ] && [ -s "$d/progress.json" ]; then'
            f' printf "%s " "{PROGRESS_MARK} {j} {a}";'
            f' {read_progress} | tr -d "\\n\\r"; echo; fi',
            *restart_lines(j, a),
            f'if [ -f "$d/{STORE_STATUS_FILE}" ] && [ -s "$d/{STORE_STATUS_FILE}" ]; then'
            f' printf "%s " "{STORE_MARK} {j} {a}";'
            f" {read_store}"
            ' | tr -d "\\n\\r"; echo; fi',
        ]
    return "\n".join(lines) + "\n"


def parse_status(stdout: str) -> dict[tuple[int, int], RemoteJobState]:
    """Read `status_probe` output; an unreadable line for an attempt makes it `unknown`.
    Never raises: what the attempts' files held is text here, parsed by `parse_progress`
    and `as_int`, which return None for anything they do not read."""
    states: dict[tuple[int, int], tuple[str, int | None]] = {}
    logs: dict[tuple[int, int], list[str]] = {}
    progress: dict[tuple[int, int], ProgressPoint] = {}
    cannot_start: set[tuple[int, int]] = set()
    store_error: set[tuple[int, int]] = set()
    store: dict[tuple[int, int], dict[str, object]] = {}
    digests: dict[tuple[int, int], tuple[tuple[str, int, str], ...]] = {}
    marked = {CANNOT_START_MARK: cannot_start, STORE_ERROR_MARK: store_error}
    for line in output_lines(stdout):
        mark = line.split(" ", 1)[0]
        if mark in marked:
            ids = [as_int(p) for p in line.split()[1:]]
            if len(ids) == 2 and ids[0] is not None and ids[1] is not None:
                marked[mark].add((ids[0], ids[1]))
            continue
        if mark == STORE_MARK:
            parts = line.split(" ", 3)
            key = tuple(as_int(p) for p in parts[1:3]) if len(parts) == 4 else (None, None)
            status = parse_store_status(parts[3]) if len(parts) == 4 else None
            if key[0] is not None and key[1] is not None and status is not None:
                store[(key[0], key[1])] = status
                digests[(key[0], key[1])] = tuple(reported(load_json(parts[3])))
            continue
        if line.startswith(PROGRESS_MARK + " "):
            parts = line.split(" ", 3)
            key = tuple(as_int(p) for p in parts[1:3]) if len(parts) == 4 else (None, None)
            point = parse_progress(parts[3]) if len(parts) == 4 else None
            if key[0] is not None and key[1] is not None and point is not None:
                progress[(key[0], key[1])] = point
            continue
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
            if code is not None and not 0 <= code <= MAX_EXIT_CODE:
                code = None  # not what a wrapper or a kill writes: garbage
            states[(job_id, attempt)] = ("exited", code)
        else:
            states[(job_id, attempt)] = (parts[3], None)
    fenced = parse_fenced(stdout)
    return {
        key: RemoteJobState(
            state,
            code,
            log_tail(logs.get(key, [])),
            fenced.get(key),
            progress.get(key),
            key in cannot_start,
            key in store_error,
            store.get(key),
            bad_exit_code=state == "exited" and code is None,
            store_digests=digests.get(key, ()),
        )
        for key, (state, code) in states.items()
    }


def log_tail(lines: Sequence[str]) -> str:
    """The last `LOG_TAIL_LINES` lines of what the probe read of a log, printable (no NUL or
    other control character: it may end up in a reason or on a terminal), every URL in
    it redacted (a store's endpoint may carry a password)."""
    return scrub_urls(printable("\n".join(lines[-LOG_TAIL_LINES:])))
