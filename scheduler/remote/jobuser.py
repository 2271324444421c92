"""Jobs under their own Unix account (`rlfleet vm add/set --job-user J`).

The scheduler's SSH account S keeps everything that is the scheduler's: the attempt
directory `$d` and its control files (pid, exit_code, lease, fenced_reason, diagnostics,
launch.sh, store.json), train.log (opened by S's wrapper and handed to the job as its
stdout/stderr), S's home and its startup files, and the store credentials (`~/.aws`, the
VM's env file, `job.env`: all S's, mode 0600). The job runs as J, started by S through one
fixed sudo rule (`S ALL=(J) NOPASSWD: ALL`, deploy/bootstrap-vm.sh), with exactly the
environment it gets without a job user (the wrapper's subshell composes it as S and hands
it over on a pipe, never on a command line).

What J writes is `$d/job/` (`JOB_DIR`): owned by S, group J, mode 2770 (setgid, so what J
creates there is group J) and the job runs with umask 027, so S (a member of group J) reads
it for uploads, pulls and logs, and nobody else does. Its progress.json is there, its
TMPDIR, its working directory, its working copy of the workdir (`work/`) and a group
supervisor's `roles.json` and role logs: `$d/progress.json`, `$d/work`, `$d/roles.json`
and `$d/<role>.log` are S's links to them, which J cannot change. The output directory
gets the same group and mode; a checkpoint S's store agent restored there is made J's to
change too. J reaches `$d/job` through the attempt's
directories, which get group J and `g+x` (search only, no listing beyond what their mode
already gives, never write).

Signals: S's kill reaches S's own processes (the wrapper) and sudo, which relays them to
the job's first process; the rest of the job's processes are J's, so every kill and
liveness check is also made as J (`as_job_user`), J signalling only its own processes.
J cannot signal S's wrapper nor sudo (root), nor write anything of `$d` but `$d/job`.

Every function here only builds shell text; `job_user` is validated (`check_job_user`)
before it goes into any of it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

JOB_DIR = "job"
"""The directory of an attempt that its job user writes (relative to the attempt's)."""
JOB_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
"""A POSIX-portable user name as useradd accepts it by default: lowercase letters, digits,
'_' and '-', not starting with a digit or '-', at most 32 characters."""


def job_user_problem(name: object) -> str | None:
    """Why `name` cannot be a job user, or None."""
    if not isinstance(name, str) or not JOB_USER_RE.fullmatch(name):
        return (
            f"invalid job user {name!r}: use a POSIX user name (lowercase letters, digits, "
            "'_' or '-', starting with a letter or '_', at most 32 characters)"
        )
    if name == "root":
        return "the job user cannot be root"
    return None


def check_job_user(name: object) -> str:
    """`name` if it is a valid job user; else `ValueError` (a bad row fails that VM's
    launches, never a daemon)."""
    problem = job_user_problem(name)
    if problem is not None:
        raise ValueError(problem)
    assert isinstance(name, str)
    return name


@dataclass(frozen=True)
class JobUserProblem:
    """Why a VM row's job user cannot be used (its launches and kills fail, counted)."""

    why: str


def checked_job_user(target: Any) -> str | None | JobUserProblem:
    """The job user of a VM (`VMTarget`) as its row holds it, checked again here: None
    (none), the name, or a `JobUserProblem` for a value no row should hold."""
    name = getattr(target, "job_user", None)
    if name is None:
        return None
    problem = job_user_problem(name)
    if problem is None:
        return str(name)
    return JobUserProblem(f"VM {getattr(target, 'name', '?')}: {problem}")


def sudo_words(job_user: str) -> str:
    """The words that run a command as `job_user`: never a password prompt (`-n`)."""
    return f"sudo -n -u {shlex.quote(check_job_user(job_user))} --"


def as_job_user(job_user: str, lines: Sequence[str], args: str = '"$d"') -> str:
    """One shell command running `lines` as `job_user` in `/bin/sh`, with `$1`.. set from
    `args` (shell words of the caller's); its errors go nowhere."""
    script = shlex.quote("\n".join(lines))
    return f"{sudo_words(job_user)} /bin/sh -c {script} sh {args} 2>/dev/null"


def group_signal(signal: str, pgid: str, job_user: str | None) -> str:
    """A shell condition: `kill -<signal> -<pgid>` reached some process of the group, as S
    and (with a job user) as J too. `pgid` is a shell word."""
    own = f"kill -{signal} -{pgid} 2>/dev/null"
    if job_user is None:
        return own
    theirs = as_job_user(job_user, [f'kill -{signal} -"$1"'], pgid)
    return (
        f'{{ rlfleet_ok=; {own} && rlfleet_ok=1; {theirs} && rlfleet_ok=1; [ -n "$rlfleet_ok" ]; }}'
    )


def marked_as_job_user(
    job_user: str, lines: Sequence[str], indent: str, outside: str | None = None
) -> list[str]:
    """`lines` (a loop over the attempt's marked processes, `marked_kill_lines` with
    `outside` as `"$o"`) run again as J, where the marker's directory is `$d/job`."""
    head = [f'd="$1"/{JOB_DIR}', 'o="${2:-}"']
    args = '"$d"' + (f" {outside}" if outside is not None else "")
    return [f"{indent}{as_job_user(job_user, [*head, *lines], args)}"]


def progress_dir(job_user: str | None) -> str:
    """The directory (a shell word) of the attempt's progress.json: `$d`, or `$d/job`."""
    return '"$d"' if job_user is None else f'"$d/{JOB_DIR}"'


def setup_lines(job_user: str | None, output_dir: str, work_dir: str | None = None) -> list[str]:
    """Wrapper lines (as S, before training) that make `$d/job` and the output directory
    (a shell word) J's to write, and the attempt's directories J's to search. They check
    first that S is not J and that sudo to J works: otherwise `rlfleet_jerr` says why, and
    the wrapper's check (`failed_lines`) ends the attempt as one the VM cannot start."""
    if job_user is None:
        return [f"mkdir -p {output_dir}"]
    j = shlex.quote(check_job_user(job_user))
    return [
        "rlfleet_jerr=",
        # What S runs to hand the job over, found now on S's PATH (the job's environment,
        # loaded later in the training's subshell, never chooses them; the env loader skips
        # `rlfleet_*` names).
        "rlfleet_envbin=$(command -v env) || rlfleet_envbin=/usr/bin/env",
        "rlfleet_sudobin=$(command -v sudo) || rlfleet_sudobin=/usr/bin/sudo",
        f'if [ "$(id -un)" = {j} ]; then',
        f"  rlfleet_jerr={shlex.quote(f'the job user {job_user} is the scheduler account')}",
        f"elif ! {sudo_words(job_user)} /bin/true </dev/null 2>/dev/null; then",
        f"  rlfleet_jerr={shlex.quote(f'sudo -n -u {job_user} does not work here')}",
        "else",
        # The attempt's directories (S's): J may search them, never write them.
        '  for rlfleet_p in "$d" "$d/.." "$d/../.." "$d/../../.." "$d/../../../.."; do',
        f'    chgrp {j} "$rlfleet_p" 2>/dev/null && chmod g+x,g-w "$rlfleet_p" 2>/dev/null',
        "  done",
        f'  mkdir -p "$d/{JOB_DIR}/tmp" {output_dir}',
        f'  for rlfleet_p in "$d/{JOB_DIR}" "$d/{JOB_DIR}/tmp" {output_dir}; do',
        f'    {{ chgrp {j} "$rlfleet_p" && chmod 2770 "$rlfleet_p"; }} 2>/dev/null ||'
        f" rlfleet_jerr={shlex.quote(f'cannot give the attempt directories to group {job_user}')}",
        "  done",
        f"  chgrp {j} {output_dir}/.. 2>/dev/null && chmod g+x,g-w {output_dir}/.. 2>/dev/null",
        f'  ln -sfn {JOB_DIR}/progress.json "$d/progress.json"',
        *_work_lines(j, work_dir),
        "fi",
    ]


def _work_lines(j: str, work_dir: str | None) -> list[str]:
    """The attempt's copy of the job's workdir (`work_dir`, relative to `$d`), made by
    the launch as S, becomes J's to write: moved into `$d/job` (S's link to it stays where
    the wrapper and the job look for it), group J, group-writable."""
    if work_dir is None:
        return []
    w = shlex.quote(work_dir)
    return [
        f'  if [ -d "$d"/{w} ] && [ ! -L "$d"/{w} ]; then',
        f'    mv "$d"/{w} "$d/{JOB_DIR}"/{w} && ln -s {JOB_DIR}/{w} "$d"/{w}',
        f'    chgrp -R {j} "$d/{JOB_DIR}"/{w} && chmod -R g+rwX "$d/{JOB_DIR}"/{w}',
        "  fi",
    ]


SUPERVISOR = "supervisor.py"
"""`scheduler.remote.launch.SUPERVISOR_FILE`: the group supervisor in the attempt directory."""
ROLE_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
"""A group role's name as `scheduler.remote.logs` accepts one (`<role>.log`)."""


def group_lines(job_user: str | None, config: dict[str, Any] | None, group_file: str) -> list[str]:
    """For a job group's attempt with a job user: the supervisor runs as J, so it gets its
    own copy of `group_file` (the name of the attempt's `group.json`) in `$d/job`, where
    it writes `roles.json` and each role's log; `$d/roles.json` and `$d/<role>.log` are
    S's links to them, which the poll and `job logs` read (bounded) as before."""
    if job_user is None or config is None:
        return []
    j = shlex.quote(check_job_user(job_user))
    lines = [
        '[ -n "$rlfleet_jerr" ] || {',
        # J reads the supervisor (S's: J cannot change it) and its own copy of group.json,
        # whatever umask made them.
        f'  chgrp {j} "$d/{SUPERVISOR}" && chmod 0640 "$d/{SUPERVISOR}"',
        f'  cp "$d/{group_file}" "$d/{JOB_DIR}/{group_file}"',
        f'  chmod 0640 "$d/{JOB_DIR}/{group_file}"',
        f'  ln -sfn {JOB_DIR}/roles.json "$d/roles.json"',
    ]
    for role in config.get("roles", []):
        name = role.get("name") if isinstance(role, dict) else None
        if isinstance(name, str) and ROLE_NAME_RE.fullmatch(name):
            log = shlex.quote(f"{name}.log")
            lines.append(f'  ln -sfn {JOB_DIR}/{log} "$d"/{log}')
    return [*lines, "}"]


def group_file_word(job_user: str | None, group_file: str) -> str:
    """The shell word of the `group.json` the supervisor reads (its directory is where
    it writes): the attempt's, or J's copy of it."""
    if job_user is None:
        return f'"$d/{group_file}"'
    return f'"$d/{JOB_DIR}/{group_file}"'


def restored_lines(job_user: str | None, store: str | None, output_dir: str) -> list[str]:
    """After the store agent (as S) restored a checkpoint into the output directory (a
    shell word): what it wrote becomes J's to change too (group J, group-writable; what
    S does not own, J's own files, is left as it is), so training can resume from it and
    rotate it away."""
    if job_user is None or store is None:
        return []
    j = shlex.quote(check_job_user(job_user))
    return [f"  {{ chgrp -R {j} {output_dir}; chmod -R g+rwX {output_dir}; }} 2>/dev/null"]


def failed_lines(job_user: str | None) -> list[str]:
    """First lines of the wrapper's check of the VM (a subshell): it fails (exit 127,
    saying why) when `setup_lines` could not set the job user up."""
    if job_user is None:
        return []
    return ['[ -z "$rlfleet_jerr" ] || { echo "$rlfleet_jerr"; exit 127; }']


def env_lines(job_user: str | None) -> list[str]:
    """Exports of the training subshell (before the env files, which may override them):
    the job user's HOME (its own, else `$d/job`), USER, LOGNAME and TMPDIR."""
    if job_user is None:
        return []
    j = shlex.quote(check_job_user(job_user))
    return [
        f"rlfleet_jh=$(getent passwd {j} | cut -d: -f6)",
        f'[ -n "$rlfleet_jh" ] && [ -d "$rlfleet_jh" ] || rlfleet_jh="$d/{JOB_DIR}"',
        f'export HOME="$rlfleet_jh" USER={j} LOGNAME={j} TMPDIR="$d/{JOB_DIR}/tmp"',
    ]


EXEC_CODE = (
    "import os, sys\n"
    "data = sys.stdin.buffer.read()\n"
    "fd = os.open(os.devnull, os.O_RDONLY)\n"
    "os.dup2(fd, 0)\n"
    "os.close(fd)\n"
    "env = dict(e.split(b'=', 1) for e in data.split(b'\\0') if b'=' in e)\n"
    "os.umask(0o027)\n"
    "os.execvpe(sys.argv[1], sys.argv[1:], env)\n"
)
"""Run as J by `exec_lines`: reads the environment (NUL-separated, from S's subshell) on
stdin, puts /dev/null there instead, and execs the training with exactly that environment
and umask 027 (what J writes is readable by its group, which S is in, and nobody else)."""


def exec_lines(job_user: str | None, python: str) -> list[str]:
    """The training subshell's last line: exec the command (`"$@"`), as J with a job user.
    `python` (the VM's, already checked by the wrapper) runs `EXEC_CODE` isolated (`-I`);
    its path is resolved with the job's PATH (it runs as J) before sudo's own PATH
    applies; `env` and `sudo`, which run as S, were resolved with S's (`setup_lines`)."""
    if job_user is None:
        return ['  exec "$@"']
    j = shlex.quote(check_job_user(job_user))
    return [
        f"  rlfleet_py=$(command -v {shlex.quote(python)}) || exit 127",
        # `env` and `sudo` run as S: found by `setup_lines` on S's own PATH, never on the
        # job's (loaded by now), which may name a directory J can write.
        f'  "$rlfleet_envbin" -0 | "$rlfleet_sudobin" -n -u {j} --'
        f' "$rlfleet_py" -I -c {shlex.quote(EXEC_CODE)} "$@"',
    ]


def cd_lines(job_user: str | None) -> list[str]:
    """Where a job without a workdir runs: the VM account's home, or `$d/job`."""
    if job_user is None:
        return ['cd "$HOME" || exit 1']
    return [f'cd "$d/{JOB_DIR}" 2>/dev/null || cd "$d" || exit 1']


def ready_check(target: Any, check: str) -> str:
    """The poll's check that training can start on a VM (`check`: its python and
    entrypoint), preceded, for a VM with a job user, by the check that S is not J and
    that `sudo -n -u J` works: until it does, the VM stays unhealthy, and `vm show` says
    why (its launch_error and last_error)."""
    job_user = checked_job_user(target)
    if job_user is None:
        return check
    if isinstance(job_user, JobUserProblem):
        return f"{{ echo {shlex.quote(job_user.why)}; exit 127; }}"
    j = shlex.quote(job_user)
    why = shlex.quote(f"sudo -n -u {job_user} does not work here (or it is the SSH login)")
    sudo_ok = f"{sudo_words(job_user)} /bin/true </dev/null 2>/dev/null"
    return f'{{ [ "$(id -un)" != {j} ] && {sudo_ok} || {{ echo {why}; exit 127; }}; }} && {check}'
