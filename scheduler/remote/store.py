"""The lines of an attempt's `launch.sh` that run its store agent (`scheduler.store.agent`)
when its job has a store (docs/invariants.md, invariant 10): restore before training,
upload beside it, the final outputs after it. Every value is quoted.

The agent runs with the VM's python, with the VM's env file loaded (the AWS_* variables
an operator put there; `~/.aws/` is read by boto3 itself), never with the job's `job.env`,
and never inside the training process; in every mode it runs isolated, from the attempt
directory, with the VM-level PYTHONPATH only (`remote.isolated.module_words`): a job's
workdir shipping `scheduler/` is never imported in its place. Its status file is
`STORE_STATUS_FILE` in the attempt directory; `STORE_ERROR_FILE` is written (by the
wrapper only, after training, so the job cannot forge it) when the store could not be
used, with exit code `STORE_ERROR_EXIT`. A final upload that failed on a store that
answered ends the attempt with `FINAL_REFUSED_EXIT` and no such file: the job's failure,
counted.

Each agent is handed the manifest digests the job's attempts reported (`accept`, words
of `scheduler.store.binding.Accepted.words`, each quoted): only store content of those
is taken for the job's.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from scheduler.remote.env import VM_ENV_FILE, load_env_lines
from scheduler.remote.isolated import module_words
from scheduler.remote.layout import Attempt, home_path

STORE_STATUS_FILE = "store.json"
STORE_ERROR_FILE = "store_error"
STORE_ERROR_EXIT = 74
"""scheduler.store.agent.STORE_ERROR_EXIT (tests/unit/test_store.py checks they agree)."""
FINAL_FOUND_EXIT = 3
"""scheduler.store.agent.FINAL_FOUND_EXIT."""
FINAL_REFUSED_EXIT = 73
"""scheduler.store.agent.FINAL_REFUSED_EXIT."""
STORE_ERROR_MARK = "rlfleet-store-error"
STORE_MARK = "rlfleet-store"
STORE_STATUS_BYTES = 4096
"""At most this much of an attempt's store.json is read by a poll."""


def _agent(
    python: str, command: str, store: str, run: Attempt, output_dir: str, accept: Sequence[str]
) -> list[str]:
    """A subshell running one agent command with the VM's env file loaded (the uploader
    beside training at a lower CPU priority: it must not slow the training)."""
    words = ["nice", "-n", "10"] if command == "watch" else []
    words += module_words(python, "scheduler.store.agent", [
        command,
        "--store", shlex.quote(store),
        "--installation", shlex.quote(run.installation),
        "--job-id", str(int(run.job_id)),
        "--output-dir", home_path(output_dir),
        "--status", f'"$d/{STORE_STATUS_FILE}"',
        *(w for word in accept for w in ("--accept", shlex.quote(word))),
    ])  # fmt: skip
    return ["(", *load_env_lines([home_path(VM_ENV_FILE)]), "exec " + " ".join(words), ")"]


def restore_lines(
    python: str, store: str, run: Attempt, output_dir: str, accept: Sequence[str] = ()
) -> list[str]:
    """Before training: restore the newest complete checkpoint. Sets `rlfleet_skip` when
    training must not start: the final outputs are in the store already (rc 0), the store
    failed (rc `STORE_ERROR_EXIT`), or the attempt was killed meanwhile."""
    return [
        f'rm -f "$d/{STORE_ERROR_FILE}"',
        *_agent(python, "restore", store, run, output_dir, accept),
        "rlfleet_st=$?",
        'if [ -n "${rlfleet_sig:-}" ]; then',
        "  rlfleet_skip=1",
        '  case "$rlfleet_sig" in INT) rc=130 ;; HUP) rc=129 ;; *) rc=143 ;; esac',
        f'elif [ "$rlfleet_st" -eq {FINAL_FOUND_EXIT} ]; then',
        "  rlfleet_skip=1; rc=0",
        'elif [ "$rlfleet_st" -ne 0 ]; then',
        f"  rlfleet_skip=1; rc={STORE_ERROR_EXIT}; rlfleet_store_failed=1",
        '  echo "rlfleet: the job\'s store cannot be used (exit $rlfleet_st)"',
        "fi",
    ]


def watch_start_lines(
    python: str, store: str, run: Attempt, output_dir: str, accept: Sequence[str] = ()
) -> list[str]:
    """Start the uploader in the background (its pid in `rlfleet_up`)."""
    lines = _agent(python, "watch", store, run, output_dir, accept)
    return [*lines[:-1], ") &", "rlfleet_up=$!"]


def finish_lines(
    python: str, store: str, run: Attempt, output_dir: str, accept: Sequence[str] = ()
) -> list[str]:
    """After training: stop the uploader, upload what it had not, and after an exit 0 the
    final outputs and marker; a failure there makes the attempt a store error when the
    store did not answer, else the job's failure (`FINAL_REFUSED_EXIT`)."""
    finish = _agent(python, "finish", store, run, output_dir, accept)
    final = [*finish[:-2], finish[-2] + " --final", finish[-1]]
    return [
        'kill "$rlfleet_up" 2>/dev/null; wait "$rlfleet_up" 2>/dev/null',
        f'rm -f "$d/{STORE_ERROR_FILE}"',
        'if [ -z "${rlfleet_sig:-}" ] && [ "$rc" -eq 0 ]; then',
        *final,
        "  rlfleet_st=$?",
        f'  if [ "$rlfleet_st" -eq {FINAL_REFUSED_EXIT} ]; then rc={FINAL_REFUSED_EXIT};',
        f'  elif [ "$rlfleet_st" -ne 0 ]; then rc={STORE_ERROR_EXIT}; rlfleet_store_failed=1; fi',
        'elif [ -z "${rlfleet_sig:-}" ]; then',
        *finish,
        "fi",
    ]


def store_error_lines() -> list[str]:
    """At the end: mark a store error as the wrapper's own (the probe reports it), and
    remove any such mark the job wrote itself: only the wrapper's variables decide,
    never a file or variable of the job."""
    return [
        'if [ -n "${rlfleet_store_failed:-}" ]; then'
        f' echo "$rc" > "$d/{STORE_ERROR_FILE}"; else rm -f "$d/{STORE_ERROR_FILE}"; fi',
    ]
