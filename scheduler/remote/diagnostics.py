"""What the poller captures of an attempt before it stops it as hung or stuck starting
(`scheduler.hang`): one command over SSH that prints what it gathered and saves it as
`diagnostics.txt` in the attempt directory, both bounded (`DIAGNOSTICS_BYTES`).

The attempt directory is the job's to write (docs/invariants.md, invariant 9): every file
of it is read with a byte bound (`head -c`, `tail -c`) and, where `timeout` exists, a time
bound; what is printed comes from the capture's own pipeline, never read back from a path
there; the saved copy is written into a file `mktemp` made and renamed into place
(`_save_lines`). A link or FIFO the job left at `diagnostics.txt` is replaced, never
followed.

It holds, in this order: a header (VM, the VM's clock, why, the attempt's GPUs),
`nvidia-smi` of the attempt's GPUs and the VM's compute processes, the end of train.log,
and the Python stacks of each process of the attempt (`py-spy dump --pid P`; its process
group, led by the wrapper's pid, and what the job started outside it, found by its
environment marker) where py-spy is installed: on the VM's PATH or beside the VM's python
(`pip install 'rlfleet[train]'` puts it there). py-spy needs the right to trace the
process: the same account suffices where the kernel allows it (`kernel.yama.ptrace_scope`
0), else its error line is kept in the stacks' place.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from scheduler.remote.kill import _marked_lines
from scheduler.remote.layout import Attempt
from scheduler.remote.output import PID_BYTES, pid_check_lines, printable

DIAGNOSTICS_FILE = "diagnostics.txt"
DIAGNOSTICS_BYTES = 256 * 1024
"""Most bytes of `diagnostics.txt` (and of what the poller keeps of it)."""
MAX_PROCESSES = 16
"""Most processes of an attempt whose stacks are dumped."""
STACK_BYTES = 12 * 1024
"""Most bytes of one process's stacks."""
LOG_TAIL_BYTES = 32 * 1024
"""Most bytes of the end of train.log."""
SMI_BYTES = 16 * 1024
"""Most bytes of each nvidia-smi view."""
STEP_TIMEOUT_S = 15
"""Most seconds one py-spy or nvidia-smi may take (where `timeout` exists)."""
TEMP_PREFIX = ".diagnostics."
"""The name `mktemp` gives the file the capture writes, before it becomes `DIAGNOSTICS_FILE`."""
BEGIN, END, NODIR = "rlfleet-diag-begin", "rlfleet-diag-end", "rlfleet-diag-nodir"


def diagnostics_script(run: Attempt, python: str, why: str, gpus: Sequence[str] = ()) -> str:
    """Shell text writing the attempt's `diagnostics.txt` and printing it between `BEGIN`
    and `END` lines (`NODIR`: the attempt has no directory on this VM). `python`: the VM's
    interpreter (py-spy is looked for beside it); `why` goes in the header; `gpus`: the
    UUIDs of the attempt's GPUs on this VM, whose nvidia-smi view is shown (all of the VM's
    without). Everything a user, a job or a VM could have chosen is quoted; what the job's
    files hold is read bounded."""
    header = f"reason: {printable(why)[:500]}"
    select = f"-i {shlex.quote(','.join(gpus))} " if gpus else ""
    held = f"GPUs of the attempt: {', '.join(gpus) or 'unknown'}"
    limit = f"timeout {STEP_TIMEOUT_S}"
    marked = _marked_lines(run, "  ")
    return "\n".join(
        [
            f"d={run.word()}",
            f'if [ ! -d "$d" ]; then echo {NODIR}; exit 0; fi',
            f'if command -v timeout >/dev/null 2>&1; then t="{limit}"; else t=; fi',
            # Every read of a file the job can write is bounded in bytes and, where
            # `timeout` exists, in time (a FIFO swapped in after a test holds no read).
            'pid=; [ -f "$d/pid" ] && pid=$($t head -c ' + f'{PID_BYTES} "$d/pid" 2>/dev/null)',
            *pid_check_lines("pid"),
            "spy=$(command -v py-spy 2>/dev/null)",
            'if [ -z "$spy" ]; then',
            f"  py=$(command -v {shlex.quote(python)} 2>/dev/null)",
            '  case "$py" in */*) [ -x "${py%/*}/py-spy" ] && spy="${py%/*}/py-spy";; esac',
            "fi",
            # The attempt's processes: its process group (the wrapper leads it), then what
            # it started outside the group, found by its environment marker.
            "pids=",
            'if [ -n "$pid" ]; then',
            "  for rlfleet_s in /proc/[0-9]*/stat; do",
            '    read -r rlfleet_st < "$rlfleet_s" 2>/dev/null || continue',
            "    rlfleet_q=${rlfleet_s#/proc/}; rlfleet_q=${rlfleet_q%/stat}",
            '    set -- ${rlfleet_st##*) }; [ "$3" = "$pid" ] && pids="$pids $rlfleet_q"',
            "  done",
            "fi",
            *marked,
            '  case " $pids " in *" $rlfleet_m "*) ;; *) pids="$pids $rlfleet_m";; esac',
            "  done",
            f'f="$d/{DIAGNOSTICS_FILE}"',
            # Kept in a variable (bounded), printed from there: nothing is read back from
            # a path in the attempt directory, which the job could have placed.
            "rlfleet_diag=$({",
            '  echo "rlfleet diagnostics: $(hostname 2>/dev/null),'
            " $(date -u '+%Y-%m-%dT%H:%M:%SZ' 2>/dev/null) by the VM's clock\"",
            f"  echo {shlex.quote(header)}",
            f"  echo {shlex.quote(held)}",
            '  echo "processes:${pids:- none found}"',
            f"  echo; echo {shlex.quote(('== nvidia-smi ' + select).strip())}",
            f"  $t nvidia-smi {select}2>&1 | head -c {SMI_BYTES}",
            "  echo; echo '== nvidia-smi --query-compute-apps'",
            "  $t nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv 2>&1"
            f" | head -c {SMI_BYTES}",
            "  echo; echo '== end of train.log'",
            f'  if [ -f "$d/train.log" ]; then $t tail -c {LOG_TAIL_BYTES} "$d/train.log"; fi',
            "  echo; n=0",
            "  for q in $pids; do",
            '    [ -r "/proc/$q/cmdline" ] || continue  # ended meanwhile',
            "    n=$((n + 1))",
            f'    if [ "$n" -gt {MAX_PROCESSES} ]; then',
            '      echo "(more processes left out)"; break',
            "    fi",
            '    echo; echo "== process $q:'
            ' $(tr "\\000" " " < "/proc/$q/cmdline" 2>/dev/null | head -c 300)"',
            '    x=$(readlink "/proc/$q/exe" 2>/dev/null)',
            '    case "${x##*/}" in',
            "      *python*) ;;",
            '      *) echo "(not a Python process: ${x:-unknown})"; continue;;',
            "    esac",
            '    if [ -z "$spy" ]; then echo "py-spy not found on the VM (pip install py-spy)";'
            f' else RUST_BACKTRACE=0 $t "$spy" dump --pid "$q" 2>&1 | head -c {STACK_BYTES}; fi',
            "  done",
            f"}} 2>&1 | head -c {DIAGNOSTICS_BYTES}; echo x)",
            "rlfleet_diag=${rlfleet_diag%x}",
            f'echo {BEGIN}; printf "%s\\n" "$rlfleet_diag"; echo {END}',
            *_save_lines(),
            "",
        ]
    )


def _save_lines() -> list[str]:
    """Shell lines saving `$rlfleet_diag` as `$f`: written into a file the capture made
    itself (`mktemp`: a new name, created exclusively), only while that is still a regular
    file and no link, in bounded time, then renamed onto `$f` (a link the job left there is
    removed first, so the rename never lands through it)."""
    return [
        f'c=$(mktemp "$d/{TEMP_PREFIX}XXXXXX" 2>/dev/null) || c=',
        'if [ -n "$c" ] && [ -f "$c" ] && [ ! -L "$c" ]; then',
        '  printf "%s" "$rlfleet_diag" | $t sh -c \'cat > "$1"\' sh "$c" 2>/dev/null',
        '  if [ -f "$c" ] && [ ! -L "$c" ]; then',
        '    if [ -L "$f" ]; then rm -f "$f"; fi',
        '    mv -f "$c" "$f" 2>/dev/null',
        "  fi",
        '  rm -f "$c" 2>/dev/null',
        "fi",
    ]


def parse_diagnostics(stdout: str) -> str | None:
    """What `diagnostics_script` printed of the file (bounded, printable); None when the
    attempt had no directory or the answer was cut off."""
    start = stdout.find(BEGIN + "\n")
    end = stdout.rfind("\n" + END)
    if start < 0 or end < start:
        return None
    text = stdout[start + len(BEGIN) + 1 : end]
    return printable(text)[:DIAGNOSTICS_BYTES]
