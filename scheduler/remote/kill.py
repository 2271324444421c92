"""The kill script: TERM, then KILL, an attempt's process group and what the job started
outside it, fencing off a launch that has not started yet (`kill_script`, `parse_kill`).

How an attempt's processes are found lives here too: the wrapper's pid checked against
/proc (`wrapper_alive`), and the environment marker every process of the attempt inherits
(`marker_pattern`, `marked_kill_lines`), which the watchdog's fence uses as well. Running
the script over SSH is `scheduler.kill`.
"""

from __future__ import annotations

import re
import shlex

from scheduler.remote import cgroup, jobuser
from scheduler.remote.layout import DIR_MARK, PRIVATE_TREE, Attempt
from scheduler.remote.output import (
    EXIT_CODE_BYTES,
    EXITED_MARK,
    NONBLOCK_LINES,
    head_bytes,
    output_lines,
    read_pid_lines,
)

KILL_MARK = "rlfleet-kill"
PID_WAIT_S = 10.0
"""How long a launch may take to write its pid, for the launch and the kill scripts."""
DEAD_KILL_OUTCOMES = frozenset({"fenced", "gone", "terminated", "killed"})
"""Kill outcomes after which the attempt surely runs no process and never will."""


def marker_pattern(run: Attempt) -> str:
    """A `grep -z` pattern for the environment entry every process of the attempt `run`
    inherits: `RLFLEET_PROGRESS_FILE` in its directory (the launch token makes it unique).
    How a kill finds what the job started outside its process group (`setsid`)."""
    rel = re.escape(run.relative).replace("\\/", "/").replace("\\-", "-")
    return f"^RLFLEET_PROGRESS_FILE=.*/{rel}/"


def _marked_lines(run: Attempt, indent: str) -> list[str]:
    """Open a loop over the pids (`$rlfleet_m`) of this VM account's processes carrying the
    attempt's marker in `$d`, this VM's directory of the attempt: a grep over
    /proc/*/environ finds the candidates by the relative directory, and the marker's own
    directory must then be `$d` itself (`-ef`: the same directory, symlinks resolved),
    since two VMs that are one host and account (the ranks of one attempt in two homes)
    share the relative directory. The caller closes the loop with `done`."""
    pattern = shlex.quote(marker_pattern(run))
    return [
        f"{indent}for rlfleet_m in $(grep -lzs -e {pattern} /proc/[0-9]*/environ 2>/dev/null); do",
        f"{indent}  rlfleet_m=${{rlfleet_m#/proc/}}; rlfleet_m=${{rlfleet_m%/environ}}",
        f'{indent}  rlfleet_v=$(tr "\\000" "\\n" < "/proc/$rlfleet_m/environ" 2>/dev/null'
        f" | grep -m 1 '^RLFLEET_PROGRESS_FILE=')",
        f"{indent}  rlfleet_v=${{rlfleet_v#RLFLEET_PROGRESS_FILE=}}",
        f'{indent}  [ "${{rlfleet_v%/*}}" -ef "$d" ] || continue',
    ]


def marked_kill_lines(
    run: Attempt,
    signal: str,
    indent: str = "",
    *,
    outside: str | None = None,
    job_user: str | None = None,
) -> list[str]:
    """Send `signal` to every process of this VM account whose environment carries the
    attempt's marker (`marker_pattern`) for this VM's directory `$d` (`_marked_lines`):
    what the job started that left its process group (`setsid`, a daemon). With `outside`
    (a shell word: a process group id), members of that group are left alone (they get the
    group's own signal, once). Only the account's own processes are readable; a process
    that cleared its environment is not found, and no /proc (not Linux) finds nothing.
    With a `job_user`, the same loop runs again as J (`jobuser.marked_as_job_user`): only
    J reads and signals J's processes."""
    if job_user is not None:
        own = marked_kill_lines(run, signal, indent, outside=outside)
        theirs = marked_kill_lines(run, signal, outside=None if outside is None else '"$o"')
        return [*own, *jobuser.marked_as_job_user(job_user, theirs, indent, outside)]
    skip = []
    if outside is not None:
        # /proc/N/stat: "pid (comm) state ppid pgrp …"; comm may hold spaces and ")".
        skip = [
            f'{indent}  read -r rlfleet_st < "/proc/$rlfleet_m/stat" 2>/dev/null || continue',
            f'{indent}  set -- ${{rlfleet_st##*) }}; [ "$3" = {outside} ] && continue',
        ]
    return [
        *_marked_lines(run, indent),
        *skip,
        f'{indent}  kill -{signal} "$rlfleet_m" 2>/dev/null',
        f"{indent}done",
    ]


def marked_alive(run: Attempt, job_user: str | None = None) -> str:
    """A shell condition: some process carrying the attempt's marker for `$d` still runs
    (with a `job_user`: one of S's, or one of J's, looked for as J)."""
    first, *body = _marked_lines(run, "")
    loop = "; ".join([*(line.strip() for line in body), "rlfleet_a=1; break; done"])
    own = f'{{ rlfleet_a=; {first} {loop}; [ -n "$rlfleet_a" ]; }}'
    if job_user is None:
        return own
    theirs = jobuser.marked_as_job_user(job_user, [own], "")[0]
    return f"{{ {own} || {theirs}; }}"


def kill_script(
    run: Attempt,
    grace_s: float = 10.0,
    *,
    pid_wait_s: float = PID_WAIT_S,
    launched: bool = False,
    job_user: str | None = None,
) -> str:
    """TERM the attempt's process group, KILL it after `grace_s`; idempotent.

    Prints `rlfleet-kill <outcome>`: `fenced` (never started, and now never will: the kill
    took the launch lock first, so a launch still on its way finds it and starts nothing),
    `gone` (nothing left to signal), `terminated` (ended within the grace period),
    `killed`, or `nopid` (a launch holds the lock but wrote no pid within `pid_wait_s`:
    its fate is unknown), or `missing` (`launched`: the scheduler recorded a pid for this
    attempt, yet its directory has none; a launch that was confirmed is never fenced, and
    its fate is unknown). After a KILL the wrapper cannot record an exit code, so the
    script writes 137 (128 + SIGKILL) for it. `gone` after an exit is followed by
    `rlfleet-exited <code>` and `rlfleet-dir <absolute directory>`.

    What the job started outside its process group (`setsid`) is found by the attempt's
    cgroup where it has one (`remote.cgroup`: TERM to each process in it with the group's,
    the whole cgroup killed with the KILL, then removed) and by its environment
    (`marked_kill_lines`), and signalled with the group. The pid file is the job's to write:
    a pid that is not a plausible one (`pid_check_lines`: never `-1`, `0`, `1`) is not
    signalled; an `exit_code` beside a live wrapper (written by someone else) does not stop
    the kill. With a `job_user` (`scheduler.remote.jobuser`), every signal and liveness
    check of the group and of the marked processes is made as J too.
    """
    ju = job_user
    term, alive0, kill9 = (jobuser.group_signal(s, '"$pid"', ju) for s in ("TERM", "0", "KILL"))
    read_code = head_bytes(EXIT_CODE_BYTES, '"$d/exit_code"')
    polls = max(1, int(grace_s / 0.1))
    pid_polls = max(1, int(pid_wait_s / 0.05))
    missing = [f'  echo "{KILL_MARK} missing"; exit 0'] if launched else []
    return "\n".join(
        [
            f"d={run.word()}",
            'if [ ! -s "$d/pid" ]; then',
            *missing,
            f'  if [ -e "$d/fenced" ]; then echo "{KILL_MARK} fenced"; exit 0; fi',
            f"  {PRIVATE_TREE}",
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
            # The job's files (pid, cgroup) read non-blocking where the VM's dd can, as
            # the poll reads them (a FIFO swapped in holds no kill).
            *NONBLOCK_LINES,
            *read_pid_lines(),
            *cgroup.read_lines(run),
            # The attempt ended (its wrapper is gone): its pid may be someone else's by now.
            # An exit code beside a live wrapper was written by someone else: kill on.
            f'if [ -s "$d/exit_code" ] && ! {{ {wrapper_alive(run)}; }}; then',
            *marked_kill_lines(run, "KILL", "  ", job_user=ju),
            "  rlfleet_cg_kill",
            f'  echo "{KILL_MARK} gone";'
            f' echo "{EXITED_MARK} $({read_code} | tr -d "\\n")";'
            f' echo "{DIR_MARK} $(cd "$d" && pwd)"; exit 0',
            "fi",
            f'if [ -n "$pid" ] && {term}; then g=1; else g=; fi',
            # What left the group gets its TERM too (the group's members only the group's).
            *marked_kill_lines(run, "TERM", outside='"$pid"', job_user=ju),
            # Everything in the attempt's cgroup, wherever it went, gets its TERM too.
            "rlfleet_cg_signal TERM",
            f'if [ -z "$g" ] && ! rlfleet_cg_busy && ! {marked_alive(run, ju)}; then',
            f'  rlfleet_cg_kill; echo "{KILL_MARK} gone"; exit 0',
            "fi",
            "n=0",
            f'while {{ [ -n "$g" ] && {alive0}; }} || rlfleet_cg_busy'
            f" || {marked_alive(run, ju)}; do",
            "  n=$((n + 1))",
            f'  if [ "$n" -gt {polls} ]; then',
            f'    [ -z "$g" ] || {kill9}',
            *marked_kill_lines(run, "KILL", "    ", job_user=ju),
            "    rlfleet_cg_kill",
            '    [ -e "$d/exit_code" ] || echo 137 > "$d/exit_code"',
            f'    echo "{KILL_MARK} killed"; exit 0',
            "  fi",
            "  sleep 0.1",
            "done",
            "rlfleet_cg_kill",  # empty by now: removed
            f'echo "{KILL_MARK} terminated"',
            "",
        ]
    )


def wrapper_alive(run: Attempt, pid: str = "$pid") -> str:
    """A shell condition: `pid` is alive and /proc shows it is the attempt's wrapper
    (without /proc this cannot be told, and the condition is false)."""
    cmdline = f"/proc/{pid}/cmdline"
    word = shlex.quote(f"{run.relative}/launch.sh")
    return (
        f'[ -n "{pid}" ] && kill -0 "{pid}" 2>/dev/null && [ -r {cmdline} ]'
        f" && grep -qaF -e {word} {cmdline}"
    )


def parse_kill(stdout: str) -> str | None:
    """The kill script's outcome word, or None if it printed none."""
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == KILL_MARK:
            return parts[1]
    return None
