"""A job's environment on its VM (docs/invariants.md, invariant 7: no secret of the
scheduler reaches a job): what it inherits, its `job.env`, and the loader that reads the
VM's and the job's env files without running them. Which names a job may set is
`validate.env_key_problem`.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.validate import SCHEDULER_ENV

PASSED_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE",
    "LC_COLLATE", "LC_MESSAGES", "LC_MONETARY", "LC_NUMERIC", "LC_TIME", "TZ", "TMPDIR",
    "RLFLEET_SIM_VM", "RLFLEET_SIM_FLEET",
)  # fmt: skip
"""What a job inherits from the shell that launches it; everything else is dropped
(`env -i`). RLFLEET_SIM_* name a simulated VM's GPUs (`rlfleet up --gpus`, tests)."""
VM_ENV_FILE = ".rlfleet/env"
"""KEY=VALUE lines on the VM (relative to $HOME) every job gets: HF_TOKEN, proxies…"""
JOB_ENV_FILE = "job.env"
"""The job's own `--env` values, in its attempt directory (mode 0600)."""


def job_env_text(env: Sequence[tuple[str, str]]) -> str:
    """The content of `job.env`: one KEY="VALUE" line per variable (values hold no
    newline). The loader strips exactly one pair of quotes, so every value comes back as
    it was, quotes of its own included."""
    return "".join(f'{key}="{value}"\n' for key, value in env)


def clean_env_words() -> str:
    """`env -i NAME=value…` keeping only `PASSED_ENV` (each one only when it is set)."""
    kept = " ".join(f'${{{name}+"{name}=${name}"}}' for name in PASSED_ENV)
    return f"env -i {kept}"


def load_env_lines(files: Sequence[str]) -> list[str]:
    """Shell lines exporting the KEY=VALUE lines of each file (shell words) that exists.

    The files are read, never run: a line is `KEY=VALUE` (an `export ` in front and one
    pair of quotes around the value are accepted), `#` starts a comment line, a key that
    is not a variable name, is the scheduler's own (`SCHEDULER_ENV`) or starts with
    `rlfleet_` (the loader's and the wrapper's own shell variables) is skipped. They run
    only in the subshell that then execs the training (`wrapper_script`), never in the
    wrapper itself: nothing they set reaches the wrapper's bookkeeping."""
    skipped = "|".join(SCHEDULER_ENV) + "|rlfleet_*"
    return [
        f"for rlfleet_f in {' '.join(files)}; do",
        '  [ -r "$rlfleet_f" ] || continue',
        '  while IFS= read -r rlfleet_l || [ -n "$rlfleet_l" ]; do',
        "    rlfleet_l=${rlfleet_l#export }",
        '    case "$rlfleet_l" in ""|"#"*) continue ;; esac',
        "    rlfleet_k=${rlfleet_l%%=*}; rlfleet_v=${rlfleet_l#*=}",
        '    [ "$rlfleet_k" = "$rlfleet_l" ] && continue',
        '    case "$rlfleet_k" in ""|[0-9]*|*[!A-Za-z0-9_]*) continue ;; esac',
        f'    case "$rlfleet_k" in {skipped}) continue ;; esac',
        '    case "$rlfleet_v" in',
        '      \\"*\\") rlfleet_v=${rlfleet_v#\\"}; rlfleet_v=${rlfleet_v%\\"} ;;',
        "      \\'*\\') rlfleet_v=${rlfleet_v#\\'}; rlfleet_v=${rlfleet_v%\\'} ;;",
        "    esac",
        '    export "$rlfleet_k=$rlfleet_v"',
        '  done < "$rlfleet_f"',
        "done",
        "unset rlfleet_f rlfleet_l rlfleet_k rlfleet_v",
    ]
