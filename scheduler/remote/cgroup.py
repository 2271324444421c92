"""A cgroup v2 per attempt, where the VM gives one: every process the attempt starts stops
with it, whatever it does to its environment or its process group (a double fork, `setsid`,
`env -i`); where none can be had, the environment marker of `remote.kill` is the fallback.

Where the cgroup comes from (`root_lines`): the directory `RLFLEET_CGROUP_ROOT` names in the
VM's `~/.rlfleet/env` (`deploy/bootstrap-vm.sh`; `none` turns cgroups off), else the cgroup
the account's shell already is in, when the account may write it (root; a delegated
cgroup). Either must be a directory of a mounted cgroup2 file system, its path plain (no
`..`, no odd character), with `cgroup.procs` writable by the account.

The wrapper (`remote.launch.wrapper_script`) creates `<root>/rlfleet-<job>-<attempt>-<token>-<its
pid>` and records it in the attempt's `cgroup` file (`setup_lines`), starts its watchdog (which
stays outside, so that it can stop the cgroup), then moves itself in (`enter_lines`) before
it starts anything else: every descendant is in it. When the training ends, the wrapper
moves itself back out, kills what is left inside and removes the cgroup (`leave_lines`).
Every other way an attempt is stopped kills the whole cgroup (`cgroup.kill` where the
kernel has it, else freeze and SIGKILL every pid until it is empty) and removes it: the
kill script (cancel, the dispatcher, the hang and startup stops, the leftover sweep:
`read_lines`, used by `remote.kill.kill_script`) and the watchdog's fence.

The `cgroup` file is in a directory the job can write, so what it holds is checked before
use (`_ok_function`): under a cgroup2 mount, a plain path, and the attempt's own name.
The poll says which way of tracking a VM gives (`probe_lines`, `parse_tracking`).

A job running as the same account as the scheduler can write its cgroup's files too (move
itself to the parent cgroup, for one): docs/security.md, "Jobs sharing a VM account".
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from scheduler.remote.env import VM_ENV_FILE
from scheduler.remote.layout import Attempt, home_path
from scheduler.remote.output import head_bytes, printable

CGROUP_FILE = "cgroup"
"""The attempt's cgroup, as its wrapper created it (in the attempt directory)."""
ROOT_KEY = "RLFLEET_CGROUP_ROOT"
"""The key in the VM's `~/.rlfleet/env` naming the cgroup attempts are made under."""
TRACKING_MARK = "rlfleet-tracking"
KILL_WAIT_POLLS = 100
"""How many times (0.05 s apart) a stop waits for its cgroup to empty."""
_PATH_CHARS = "A-Za-z0-9_./@:+=,-"
_PATH_RE = re.compile(rf"/[{_PATH_CHARS}]{{0,400}}")
STALE_MINUTES = 2
"""An empty attempt cgroup this old is a crash's leftover: the poll's probe removes it."""
MARKER = "marker"
CGROUP = "cgroup v2"


def cgroup_name(run: Attempt) -> str:
    """The attempt's cgroup's name, but for the `-<wrapper pid>` that ends it."""
    return f"rlfleet-{int(run.job_id)}-{int(run.attempt)}-{run.token}"


def _ok_function() -> list[str]:
    """`rlfleet_cg_ok PATH`: true when PATH is a plain directory path (no `.`/`..`
    component, no `//`, only `_PATH_CHARS`) on the cgroup2 mount `$rlfleet_cgm`, with a
    `cgroup.procs` (a cgroupfs has no links and no files of anyone's choosing)."""
    return [
        "rlfleet_cg_ok() {",
        '  [ -n "$rlfleet_cgm" ] || return 1',
        '  case "$1" in "$rlfleet_cgm"|"$rlfleet_cgm"/*) ;; *) return 1 ;; esac',
        f'  case "$1" in *[!{_PATH_CHARS}/]*|*/../*|*/..|*/./*|*/.|*//*) return 1 ;; esac',
        '  [ -d "$1" ] && [ -f "$1/cgroup.procs" ]',
        "}",
    ]


def _mount_lines() -> list[str]:
    """Set `rlfleet_cgm` to the (first) cgroup2 mount point, empty when there is none."""
    return [
        "rlfleet_cgm=",
        "if [ -r /proc/self/mounts ]; then",
        "  while read -r _ rlfleet_p rlfleet_t _; do",
        '    if [ "$rlfleet_t" = cgroup2 ]; then rlfleet_cgm=${rlfleet_p%/}; break; fi',
        "  done < /proc/self/mounts",
        "fi",
    ]


def functions_lines() -> list[str]:
    """The shell functions every user of an attempt's cgroup `$rlfleet_cg` needs:
    `rlfleet_cg_busy` (a process is in it or below), `rlfleet_cg_signal SIG` (signal each
    one) and `rlfleet_cg_kill` (kill them all, wait until it is empty, remove it and the
    cgroups the job made under it). All do nothing when `$rlfleet_cg` is empty or gone."""
    procs = '$(find "$rlfleet_cg" -name cgroup.procs -exec cat {} + 2>/dev/null)'
    return [
        *_mount_lines(),
        *_ok_function(),
        "rlfleet_cg_busy() {",
        '  [ -n "$rlfleet_cg" ] && grep -qs "^populated 1" "$rlfleet_cg/cgroup.events"',
        "}",
        "rlfleet_cg_signal() {",
        '  [ -n "$rlfleet_cg" ] && [ -d "$rlfleet_cg" ] || return 0',
        f'  for rlfleet_p in {procs}; do kill -"$1" "$rlfleet_p" 2>/dev/null; done',
        "}",
        "rlfleet_cg_kill() {",
        '  [ -n "$rlfleet_cg" ] && [ -d "$rlfleet_cg" ] || return 0',
        '  if [ -e "$rlfleet_cg/cgroup.kill" ]; then',
        '    { echo 1 > "$rlfleet_cg/cgroup.kill"; } 2>/dev/null',
        "  else",
        # No cgroup.kill (Linux < 5.14): freeze, so that nothing forks meanwhile, then
        # KILL each pid (a frozen process dies of SIGKILL) until none is left.
        '    { echo 1 > "$rlfleet_cg/cgroup.freeze"; } 2>/dev/null',
        "    rlfleet_i=0",
        f'    while [ "$rlfleet_i" -lt {KILL_WAIT_POLLS} ] && rlfleet_cg_busy; do',
        "      rlfleet_cg_signal KILL; rlfleet_i=$((rlfleet_i + 1)); sleep 0.05",
        "    done",
        '    { echo 0 > "$rlfleet_cg/cgroup.freeze"; } 2>/dev/null',
        "  fi",
        "  rlfleet_i=0",
        f'  while [ "$rlfleet_i" -lt {KILL_WAIT_POLLS} ] && rlfleet_cg_busy; do',
        "    rlfleet_i=$((rlfleet_i + 1)); sleep 0.05",
        "  done",
        '  find "$rlfleet_cg" -depth -type d -exec rmdir {} + 2>/dev/null',
        "  return 0",
        "}",
    ]


def root_lines() -> list[str]:
    """Set `rlfleet_cgr` to the cgroup attempts are made under (empty: none), and
    `rlfleet_cgw` to why there is none. Needs `functions_lines` first."""
    env = home_path(VM_ENV_FILE)
    # Read, never run; at most 64 KiB; only a regular file, opened non-blocking where the
    # VM's dd can (`output.head_bytes`: a FIFO swapped in after the test holds nothing).
    read = (
        f"rlfleet_v=$({head_bytes(65536, env)}"
        f" | sed -n -e 's/^export //' -e 's/^{ROOT_KEY}=/=/p' | tail -n 1)"
    )
    return [
        "rlfleet_cgr=; rlfleet_cgw=; rlfleet_v=",
        f"if [ -f {env} ]; then {read}; fi",
        # `=` in front: set (perhaps to nothing); one pair of quotes stripped, as the loader does.
        'rlfleet_set=; if [ -n "$rlfleet_v" ]; then rlfleet_set=1; rlfleet_v=${rlfleet_v#=}; fi',
        'case "$rlfleet_v" in',
        '  \\"*\\") rlfleet_v=${rlfleet_v#\\"}; rlfleet_v=${rlfleet_v%\\"} ;;',
        "  \\'*\\') rlfleet_v=${rlfleet_v#\\'}; rlfleet_v=${rlfleet_v%\\'} ;;",
        "esac",
        'if [ -z "$rlfleet_cgm" ]; then rlfleet_cgw="no cgroup v2 mounted"',
        'elif [ -n "$rlfleet_set" ]; then',
        "  rlfleet_v=${rlfleet_v%/}",
        f'  if [ "$rlfleet_v" = none ]; then rlfleet_cgw="{ROOT_KEY}=none"',
        '  elif rlfleet_cg_ok "$rlfleet_v" && [ -w "$rlfleet_v" ]'
        ' && [ -w "$rlfleet_v/cgroup.procs" ]; then rlfleet_cgr=$rlfleet_v',
        f'  else rlfleet_cgw="{ROOT_KEY} is not a writable cgroup v2 directory"; fi',
        "else",
        # The cgroup this shell is in (`0::/path` of the unified hierarchy).
        '  rlfleet_v=$(sed -n "s/^0:://p" /proc/self/cgroup 2>/dev/null | head -n 1)',
        '  if [ -n "$rlfleet_v" ]; then',
        '    rlfleet_v="$rlfleet_cgm${rlfleet_v%/}"',
        '    if rlfleet_cg_ok "$rlfleet_v" && [ -w "$rlfleet_v" ]'
        ' && [ -w "$rlfleet_v/cgroup.procs" ]; then rlfleet_cgr=$rlfleet_v; fi',
        "  fi",
        '  [ -n "$rlfleet_cgr" ] || rlfleet_cgw="no writable cgroup v2"',
        "fi",
    ]


def setup_lines(run: Attempt) -> list[str]:
    """The wrapper's first step (before its watchdog): find the root, create the attempt's
    cgroup `$rlfleet_cg` and record it in the attempt's `cgroup` file; on any failure,
    `$rlfleet_cg` is empty and the marker is all there is."""
    name = shlex.quote(cgroup_name(run))
    return [
        *functions_lines(),
        *root_lines(),
        "rlfleet_cg=",
        'if [ -n "$rlfleet_cgr" ]; then',
        # The wrapper's pid in the name too: two VMs that are one host and account (the
        # ranks of one attempt in two homes) each get their own.
        f'  rlfleet_cg="$rlfleet_cgr"/{name}-$$',
        '  if mkdir "$rlfleet_cg" 2>/dev/null'
        f' && printf "%s\\n" "$rlfleet_cg" > "$d/{CGROUP_FILE}.tmp"'
        f' && mv -f "$d/{CGROUP_FILE}.tmp" "$d/{CGROUP_FILE}"; then :',
        '  else rmdir "$rlfleet_cg" 2>/dev/null; rlfleet_cg=; rlfleet_cgw="cannot create a cgroup"'
        "; fi",
        "fi",
    ]


def enter_lines() -> list[str]:
    """The wrapper moves itself into its cgroup (after its watchdog started, before
    anything else); it says in train.log how the attempt's processes are tracked."""
    return [
        'if [ -n "$rlfleet_cg" ] && ! { echo "$$" > "$rlfleet_cg/cgroup.procs"; } 2>/dev/null;'
        " then",
        f'  rm -f "$d/{CGROUP_FILE}"; rmdir "$rlfleet_cg" 2>/dev/null; rlfleet_cg=',
        '  rlfleet_cgw="cannot move into a cgroup"',
        "fi",
        'if [ -n "$rlfleet_cg" ]; then echo "rlfleet: processes tracked by cgroup $rlfleet_cg"',
        'else echo "rlfleet: processes tracked by the environment marker ($rlfleet_cgw)"; fi',
    ]


def leave_lines() -> list[str]:
    """When the training has ended: the wrapper moves itself back to the root and kills
    whatever the attempt left in its cgroup, then removes it (a move that fails leaves
    that to the next kill of the attempt)."""
    return [
        'if [ -n "$rlfleet_cg" ] && { echo "$$" > "$rlfleet_cgr/cgroup.procs"; } 2>/dev/null;'
        " then rlfleet_cg_kill; fi",
    ]


def read_lines(run: Attempt) -> list[str]:
    """For a kill of the attempt in `$d` (after `d=`): define the functions and set
    `$rlfleet_cg` to the cgroup its `cgroup` file names, if that is a cgroup of this
    attempt's name on a cgroup2 mount (the file is the job's to write); else empty."""
    name = cgroup_name(run)
    read_file = head_bytes(4096, f'"$d/{CGROUP_FILE}"')
    return [
        *functions_lines(),
        "rlfleet_cg=",
        f'if [ -f "$d/{CGROUP_FILE}" ]; then',
        f"  rlfleet_cg=$({read_file} | head -n 1)",
        f'  case "${{rlfleet_cg%-*}}" in */{name}) ;; *) rlfleet_cg= ;; esac',
        '  case "${rlfleet_cg##*-}" in ""|*[!0-9]*) rlfleet_cg= ;; esac',
        '  rlfleet_cg_ok "$rlfleet_cg" || rlfleet_cg=',
        "fi",
    ]


def probe_lines() -> list[str]:
    """Poll lines printing `rlfleet-tracking cgroup2 <kill|freeze> <root>` when a launch
    now would get a cgroup (tried for real: a cgroup made, a process moved in, removed),
    else `rlfleet-tracking marker <why>`; they also remove the empty attempt cgroups a
    crash left under the root (`STALE_MINUTES`)."""
    move = shlex.quote('echo "$$" > "$1/cgroup.procs"')
    names = r"\( -name 'rlfleet-[0-9]*' -o -name 'rlfleet-probe-*' \)"
    return [
        *functions_lines(),
        *root_lines(),
        'if [ -n "$rlfleet_cgr" ]; then',
        # What a crash left (a wrapper killed outright, a poll cut short): attempt and
        # probe cgroups older than STALE_MINUTES and empty (rmdir removes nothing else; a
        # live attempt's wrapper is in its cgroup from seconds after it is made).
        f'  find "$rlfleet_cgr" -mindepth 1 -maxdepth 1 -type d {names}'
        f" -mmin +{STALE_MINUTES} -exec rmdir {{}} + 2>/dev/null",
        '  rlfleet_pt="$rlfleet_cgr/rlfleet-probe-$$"; rlfleet_how=',
        '  if mkdir "$rlfleet_pt" 2>/dev/null; then',
        f'    if sh -c {move} sh "$rlfleet_pt" 2>/dev/null; then',
        '      rlfleet_how=freeze; [ ! -e "$rlfleet_pt/cgroup.kill" ] || rlfleet_how=kill',
        "    fi",
        '    rmdir "$rlfleet_pt" 2>/dev/null || { sleep 0.1; rmdir "$rlfleet_pt" 2>/dev/null; }',
        "  fi",
        '  if [ -n "$rlfleet_how" ]; then',
        f'    echo "{TRACKING_MARK} cgroup2 $rlfleet_how $rlfleet_cgr"',
        f'  else echo "{TRACKING_MARK} marker cannot move a process into a cgroup under'
        ' $rlfleet_cgr"; fi',
        f'else echo "{TRACKING_MARK} marker $rlfleet_cgw"; fi',
    ]


def parse_tracking(lines: Sequence[str]) -> str | None:
    """How the poll says this VM tracks an attempt's processes, as `vm show` prints it:
    `cgroup v2 (<root>, cgroup.kill)`, `cgroup v2 (<root>, freeze)` or `marker (<why>)`;
    None when the poll printed no readable line (the VM's shell printed something else)."""
    for line in lines:
        parts = line.strip().split(" ", 3)
        if len(parts) < 2 or parts[0] != TRACKING_MARK:
            continue
        if parts[1] == "cgroup2" and len(parts) == 4 and parts[2] in ("kill", "freeze"):
            if not _PATH_RE.fullmatch(parts[3]) or "/../" in parts[3] + "/":
                return None
            how = "cgroup.kill" if parts[2] == "kill" else "freeze"
            return f"{CGROUP} ({parts[3]}, {how})"
        if parts[1] == MARKER:
            why = printable(" ".join(parts[2:]))[:200].strip()
            return f"{MARKER} ({why or 'no writable cgroup v2'})"
    return None
