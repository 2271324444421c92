"""Shell snippets run on a VM: launch an attempt, kill it, read its log and progress.

Pure functions: they only BUILD POSIX `sh` text. Every value that could come from a user
(model, dataset, reward names, extra args, paths) goes through `shlex.quote`
(docs/invariants.md, invariant 5).
Layout on the VM (docs/invariants.md, invariant 6):
`~/.rlfleet/<installation>/jobs/<job_id>/<attempt>-<token>/`
holds `train.log`, `pid`, `exit_code`, `progress.json` and `launch.sh` of one attempt;
`<installation>` is the database's UUID and `<token>` is drawn when the attempt is claimed,
so nothing another installation, an earlier database or another attempt left on the VM is
ever read as this attempt's. Outputs default to `~/.rlfleet/<installation>/outputs/<job_id>`.
While an attempt runs, the poller renews its `lease` there and the attempt's watchdog
fences it (stops it and writes `fenced_reason`) when the lease runs out: see
`watchdog_lines`.
"""

from __future__ import annotations

import math
import re
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.liveness import WATCHDOG_PERIOD_S, Liveness

PID_MARK = "rlfleet-pid"
DIR_MARK = "rlfleet-dir"
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
NO_FILE_EXIT = 3
"""Exit status of the read snippets when the file does not exist (yet)."""
FENCED_EXIT = 96
"""Exit status of the launch script when a kill fenced the attempt off before it started."""
PID_WAIT_S = 10.0
"""How long a launch may take to write its pid, for the launch and the kill scripts."""
DEAD_KILL_OUTCOMES = frozenset({"fenced", "gone", "terminated", "killed"})
"""Kill outcomes after which the attempt surely runs no process and never will."""


ROOT = ".rlfleet"
"""rlfleet's directory on a VM, relative to $HOME."""
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_TOKEN = re.compile(r"[0-9a-f]{16}")


def new_token() -> str:
    """A fresh launch token: 16 random lowercase hex digits (64 bits)."""
    return secrets.token_hex(8)


def check_installation(installation: str) -> str:
    """`installation` if it is a lowercase UUID; else `ValueError`."""
    if not _UUID.fullmatch(installation):
        raise ValueError(f"not an installation id: {installation!r}")
    return installation


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job and where its files are on its VM (docs/invariants.md, invariant 6).

    `path` is the absolute directory the launch reported (None until it did); then every
    script uses it, whatever $HOME the caller's shell has. Without it the directory is
    `$HOME/<relative>`. Every field is checked: the names go into shell text.
    """

    installation: str
    job_id: int
    attempt: int
    token: str
    path: str | None = None

    def __post_init__(self) -> None:
        check_installation(self.installation)
        if not _TOKEN.fullmatch(self.token):
            raise ValueError(f"not a launch token: {self.token!r}")
        if self.job_id < 1 or self.attempt < 1:
            raise ValueError(f"no attempt {self.attempt} of job {self.job_id}")
        if self.path is not None and not (
            self.path.startswith("/")
            and self.path.endswith("/" + self.relative)
            and "\n" not in self.path
            and "\0" not in self.path
        ):
            raise ValueError(f"not the directory of {self.relative}: {self.path!r}")

    @property
    def relative(self) -> str:
        """The directory relative to $HOME: `.rlfleet/<installation>/jobs/<id>/<n>-<token>`."""
        return f"{job_base(self.installation, self.job_id)}/{int(self.attempt)}-{self.token}"

    def word(self) -> str:
        """The directory as one quoted shell word."""
        return shlex.quote(self.path) if self.path is not None else home_path(self.relative)

    def located(self, path: str | None) -> Attempt:
        """The same attempt with its recorded directory (None or invalid: unchanged)."""
        try:
            return Attempt(self.installation, self.job_id, self.attempt, self.token, path)
        except ValueError:
            return self


def stored_attempt(
    installation: str,
    job_id: int,
    attempt: int,
    token: str | None,
    attempt_dir: str | None = None,
) -> Attempt | None:
    """The `Attempt` a job or leftover row names, or None when the row has no (valid)
    token: such an attempt has no directory anyone may look at."""
    if token is None or attempt < 1:
        return None
    try:
        run = Attempt(installation, job_id, attempt, token)
    except ValueError:
        return None
    return run.located(attempt_dir)


def job_base(installation: str, job_id: int) -> str:
    """The directory of every attempt of a job, relative to $HOME."""
    return f"{ROOT}/{check_installation(installation)}/jobs/{int(job_id)}"


def default_output_dir(installation: str, job_id: int) -> str:
    """Where a job's outputs go when it names no `output_dir` (`~` is the VM's $HOME):
    per installation and per job, shared by its attempts so that `--resume auto` works."""
    return f"~/{ROOT}/{check_installation(installation)}/outputs/{int(job_id)}"


def home_path(path: str) -> str:
    """A shell word for `path`: `~/x` and relative paths are under $HOME, all quoted."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        path = path[2:]
    if path.startswith("/"):
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path)


# --- the job's environment (docs/invariants.md, invariant 7: no secret of the scheduler reaches a
# job)

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
SCHEDULER_ENV = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RLFLEET_JOB_ID", "RLFLEET_ATTEMPT",
    "RLFLEET_PROGRESS_FILE", "RLFLEET_NODE_RANK", "RLFLEET_NUM_NODES",
    "RLFLEET_GPUS_PER_NODE", "RLFLEET_NODE_ADDRS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
)  # fmt: skip
"""Set by the scheduler for every job: no env file sets them (`--env` refuses every
`RLFLEET_*` name: that namespace is the scheduler's)."""
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_key_problem(key: str) -> str | None:
    """Why `key` cannot be a job's environment variable, or None when it can."""
    if not _ENV_KEY.fullmatch(key):
        return f"{key!r} is not a variable name (letters, digits, _; not starting with a digit)"
    if key.upper().startswith("RLFLEET_") or key in SCHEDULER_ENV:
        return f"{key} is set by the scheduler"
    return None


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


@dataclass(frozen=True)
class NodeRole:
    """Where one rank of a multi-node job stands: its rank, every node's internal address
    (rank order; rank 0's is the rendezvous host) and the rendezvous port on rank 0."""

    rank: int
    addrs: tuple[str, ...]
    master_port: int

    @property
    def num_nodes(self) -> int:
        """How many nodes the job spans."""
        return len(self.addrs)


@dataclass(frozen=True)
class GroupLaunch:
    """What the group supervisor of one VM gets (`group.json`, no secret in it): the roles
    in start order with argv and own variables, the readiness checks, the variables every
    role gets, and whether a training role needs the VM's entrypoint."""

    config: dict[str, Any]
    needs_entrypoint: bool = True

    def text(self) -> str:
        """`group.json`."""
        import json

        return json.dumps(self.config, sort_keys=True)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launch needs, copied out of the job and VM rows."""

    run: Attempt
    python: str
    entrypoint: str
    gpu_indices: Sequence[int]
    model: str
    dataset: str
    reward_functions: Sequence[str]
    output_dir: str
    extra_args: Sequence[str] = ()
    gpu_uuids: Sequence[str] = ()
    """The claimed GPUs' UUIDs (in the order of `gpu_indices`): what the attempt is
    launched on. Empty only for a claim made before UUIDs were recorded."""

    @property
    def job_id(self) -> int:
        """The job's id."""
        return self.run.job_id

    @property
    def attempt(self) -> int:
        """The attempt's number (1 for the first launch)."""
        return self.run.attempt

    env: Sequence[tuple[str, str]] = ()
    """The job's `--env` values: written to `job.env` from the launch's stdin."""
    fence_after_s: float = DEFAULT_FENCE_AFTER_S
    """The watchdog stops the attempt once its lease is this old (0: no watchdog)."""
    fence_grace_s: float = DEFAULT_FENCE_GRACE_S
    """Seconds between the watchdog's TERM and its KILL."""
    node: NodeRole | None = None
    """This rank's place in a multi-node job; None for a single-node job."""
    group: GroupLaunch | None = None
    """The roles this VM runs for a job group (the supervisor replaces the training
    command); None for a job of one training role."""


def entry_words(
    python: str, entrypoint: str, num_gpus: int, node: NodeRole | None = None
) -> list[str]:
    """How training starts on the VM (docs/invariants.md, contract 5), as quoted shell
    words: `launcher_argv`, each word quoted."""
    return [shlex.quote(word) for word in launcher_argv(python, entrypoint, num_gpus, node)]


def launcher_argv(
    python: str, entrypoint: str, num_gpus: int, node: NodeRole | None = None
) -> list[str]:
    """How training starts on the VM, as argv (no shell): a `.py` entrypoint runs as a
    script, anything else as a module; more than one GPU puts `accelerate launch
    --num_processes N` in front. A rank of a multi-node job (or of a group's role on
    several nodes) always starts through accelerate's multi-process launcher (torchrun
    underneath, which gives every process its RANK and WORLD_SIZE; on a VM without CUDA
    torch then uses gloo on the CPU), with `--num_machines`, `--machine_rank` and rank 0's
    address and port; `--multi_gpu` is needed on CPUs too (without it accelerate starts
    one rank-less process).
    """
    words = [python]
    if node is not None:
        words += [
            "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_machines", str(int(node.num_nodes)),
            "--machine_rank", str(int(node.rank)),
            "--main_process_ip", node.addrs[0],
            "--main_process_port", str(int(node.master_port)),
            "--num_processes", str(int(node.num_nodes) * int(num_gpus)),
            # accelerate's defaults, passed so that a stray accelerate config file on one
            # VM cannot make its rank differ from the others (training/README.md).
            "--mixed_precision", "no", "--dynamo_backend", "no",
        ]  # fmt: skip
    elif num_gpus > 1:
        words += ["-m", "accelerate.commands.launch", "--num_processes", str(int(num_gpus))]
    if entrypoint.endswith(".py"):
        words.append(entrypoint)
    else:
        words += ["-m", entrypoint]
    return words


DEVICE_ORDER = "PCI_BUS_ID"
"""`CUDA_DEVICE_ORDER` of every attempt: CUDA then numbers GPUs as nvidia-smi does, for
tools that read indices (CUDA's own default numbers them fastest first)."""
ENTRY_BROKEN_EXIT = 127
"""Exit code of an attempt whose python or entrypoint is unusable on its VM (as the shell's
126/127 for a command that cannot run): the VM's fault, not the job's."""
ENTRY_BROKEN_MARK = "rlfleet: training cannot start on this VM"
CANNOT_START_FILE = "cannot_start"
"""Written by the wrapper (only) when its own check of the VM's python and entrypoint
failed: the one sign that an attempt's 126/127 is the VM's fault, not the job's."""
CANNOT_START_MARK = "rlfleet-cannot-start"


def visible_devices(spec: LaunchSpec) -> str:
    """`CUDA_VISIBLE_DEVICES` of an attempt: the UUIDs of the GPUs it was given, which
    name the same cards for CUDA and nvidia-smi whatever their numbering
    (docs/invariants.md, invariant 8). Indices only for a claim without UUIDs."""
    if spec.gpu_uuids:
        return ",".join(str(u) for u in spec.gpu_uuids)
    return ",".join(str(int(i)) for i in spec.gpu_indices)


def entry_check_words(python: str, entrypoint: str) -> list[str]:
    """A command that exits 0 when `python` runs and finds `entrypoint` (a readable `.py`
    script, or an importable module); otherwise its last line of output says why."""
    if entrypoint.endswith(".py"):
        code = "import sys; open(sys.argv[1]).close()"
    else:
        code = (
            "import importlib.util, sys; "
            "sys.exit(0 if importlib.util.find_spec(sys.argv[1]) "
            'else "No module named " + sys.argv[1])'
        )
    return [shlex.quote(python), "-c", shlex.quote(code), shlex.quote(entrypoint)]


def train_words(spec: LaunchSpec) -> list[str]:
    """The full, quoted training command of one attempt."""
    words = entry_words(spec.python, spec.entrypoint, len(spec.gpu_indices), spec.node)
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

    The job's environment (the VM's env file, then the job's `job.env`) is loaded only in
    the subshell that execs the training, after the scheduler's variables and the training
    command are set there: no variable of the job reaches the wrapper's own (`d`,
    `rlfleet_sig`, `rlfleet_wd`, `PATH`…), so a job cannot redirect its exit code, fake a
    signal or make the wrapper's check of python fail (docs/invariants.md, invariant 9).
    Only that check (run with the VM's env file, not the job's) says the VM cannot run
    training: it writes `CANNOT_START_FILE`; any exit code of the training itself, 126 and
    127 included, is the job's.
    """
    d = spec.run.word()
    command = train_words(spec) if spec.group is None else supervisor_words(spec)
    return "\n".join(
        [
            "#!/bin/sh",
            f"# rlfleet job {int(spec.job_id)} attempt {int(spec.attempt)}",
            f"d={d}",
            'echo "$$" > "$d/pid.tmp" && mv -f "$d/pid.tmp" "$d/pid"',
            "trap 'rlfleet_sig=TERM' TERM",
            "trap 'rlfleet_sig=INT' INT",
            "trap 'rlfleet_sig=HUP' HUP",
            *watchdog_lines(spec.fence_after_s, spec.fence_grace_s, spec.run),
            'cd "$HOME" || exit 1',
            f"mkdir -p {home_path(spec.output_dir)}",
            'echo "rlfleet: attempt started on $(hostname) at $(date -u +%FT%TZ)'
            f' CUDA_VISIBLE_DEVICES="{shlex.quote(visible_devices(spec))}',
            # A python or entrypoint the VM cannot run ends the attempt with 127 and one
            # line saying why, before training starts (the poller marks the VM). The check
            # sees the VM's env file (a PATH set there), never the job's own variables.
            "rlfleet_check=$(",
            *load_env_lines([home_path(VM_ENV_FILE)]),
            f"  {' '.join(_check_words(spec))} 2>&1",
            ")",
            "rc=$?",
            # Killed meanwhile: training never starts, the exit code says by what.
            'if [ -n "${rlfleet_sig:-}" ]; then',
            '  case "$rlfleet_sig" in INT) rc=130 ;; HUP) rc=129 ;; *) rc=143 ;; esac',
            'elif [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ]; then',
            f'  [ "$rc" -eq 126 ] || rc={ENTRY_BROKEN_EXIT}',
            f'  echo "{ENTRY_BROKEN_MARK} (exit $rc):'
            ' $(printf "%s\\n" "$rlfleet_check" | tail -n 1)"',
            f'  echo "$rc" > "$d/{CANNOT_START_FILE}"',
            'elif [ "$rc" -eq 0 ]; then',
            # The training in a subshell: the command and the scheduler's variables first
            # (the loader skips their names), then the job's environment, then exec.
            "  (",
            "  set -- " + " ".join(command),
            f"  export CUDA_VISIBLE_DEVICES={shlex.quote(visible_devices(spec))}",
            f"  export CUDA_DEVICE_ORDER={DEVICE_ORDER}",
            '  export RLFLEET_PROGRESS_FILE="$d/progress.json"',
            f"  export RLFLEET_JOB_ID={int(spec.job_id)} RLFLEET_ATTEMPT={int(spec.attempt)}",
            *("  " + line for line in rendezvous_lines(spec)),
            *load_env_lines([home_path(VM_ENV_FILE), f'"$d/{JOB_ENV_FILE}"']),
            '  exec "$@"',
            "  )",
            "  rc=$?",
            # Only the check above may say the VM cannot start training, not the job.
            f'  rm -f "$d/{CANNOT_START_FILE}"',
            "fi",
            *watchdog_stop_lines(),
            'echo "$rc" > "$d/exit_code.tmp" && mv -f "$d/exit_code.tmp" "$d/exit_code"',
            'echo "rlfleet: attempt ended with exit code $rc"',
            "",
        ]
    )


SUPERVISOR_FILE = "supervisor.py"
GROUP_FILE = "group.json"


def _check_words(spec: LaunchSpec) -> list[str]:
    """The wrapper's check that training can start: the VM's python and entrypoint, or
    only its python for a group without a training role."""
    if spec.group is not None and not spec.group.needs_entrypoint:
        return [shlex.quote(spec.python), "-c", "pass"]
    return entry_check_words(spec.python, spec.entrypoint)


def supervisor_words(spec: LaunchSpec) -> list[str]:
    """The command of a job group's attempt: the supervisor with its `group.json`."""
    return [shlex.quote(spec.python), "-u", f'"$d/{SUPERVISOR_FILE}"', f'"$d/{GROUP_FILE}"']


def supervisor_source() -> str:
    """The text of `scheduler/supervisor.py`, shipped into each group attempt directory."""
    from pathlib import Path

    return (Path(__file__).with_name("supervisor.py")).read_text(encoding="utf-8")


def _group_files_lines(spec: LaunchSpec) -> list[str]:
    """Lines of the launch that write the supervisor and its `group.json` (none for a job
    of one training role)."""
    if spec.group is None:
        return []
    return [
        f'  printf "%s" {shlex.quote(supervisor_source())} > "$d/{SUPERVISOR_FILE}" || exit 97',
        f'  printf "%s" {shlex.quote(spec.group.text())} > "$d/{GROUP_FILE}" || exit 97',
    ]


def rendezvous_env(node: NodeRole, per_node: int) -> dict[str, str]:
    """What a rank of a multi-node job (or of a group's role on several nodes) is told of
    where it stands: RLFLEET_NODE_RANK, RLFLEET_NUM_NODES, RLFLEET_GPUS_PER_NODE,
    RLFLEET_NODE_ADDRS (rank order), MASTER_ADDR (rank 0), MASTER_PORT, WORLD_SIZE (one
    process per GPU, at least one per node)."""
    return {
        "RLFLEET_NODE_RANK": str(int(node.rank)),
        "RLFLEET_NUM_NODES": str(int(node.num_nodes)),
        "RLFLEET_GPUS_PER_NODE": str(int(per_node)),
        "RLFLEET_NODE_ADDRS": ",".join(node.addrs),
        "MASTER_ADDR": node.addrs[0],
        "MASTER_PORT": str(int(node.master_port)),
        "WORLD_SIZE": str(int(node.num_nodes) * max(1, int(per_node))),
    }


def rendezvous_lines(spec: LaunchSpec) -> list[str]:
    """The exports of `rendezvous_env` for a rank of a multi-node job (none for a
    single-node job), every value quoted."""
    if spec.node is None:
        return []
    env = rendezvous_env(spec.node, len(spec.gpu_indices))
    lines = (
        ("RLFLEET_NODE_RANK", "RLFLEET_NUM_NODES", "RLFLEET_GPUS_PER_NODE"),
        ("RLFLEET_NODE_ADDRS",),
        ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"),
    )
    return ["export " + " ".join(f"{k}={shlex.quote(env[k])}" for k in keys) for keys in lines]


FREE_PORT_MARK = "rlfleet-port"


def free_port_script(python: str) -> str:
    """Ask the VM for a TCP port free right now (bind port 0): the rendezvous port of a
    multi-node job, chosen on rank 0's VM at launch time. Prints `rlfleet-port <port>`."""
    code = (
        "import socket; s = socket.socket(); s.bind(('', 0)); "
        f"print('{FREE_PORT_MARK}', s.getsockname()[1])"
    )
    return f"{shlex.quote(python)} -c {shlex.quote(code)}"


def free_ports_script(python: str, count: int) -> str:
    """Ask the VM for `count` distinct TCP ports free right now (all bound at once, then
    released): the named ports of a job group's roles. Prints one `rlfleet-port <port>`
    line each."""
    code = (
        "import socket, sys\n"
        "socks = [socket.socket() for _ in range(int(sys.argv[1]))]\n"
        "for s in socks: s.bind(('', 0))\n"
        f"for s in socks: print('{FREE_PORT_MARK}', s.getsockname()[1])\n"
    )
    return f"{shlex.quote(python)} -c {shlex.quote(code)} {int(count)}"


def parse_free_ports(stdout: str) -> list[int]:
    """Every distinct port `free_ports_script` printed, in order."""
    ports: list[int] = []
    for line in output_lines(stdout):
        word, _, value = line.partition(" ")
        port = as_int(value) if word == FREE_PORT_MARK else None
        if port is not None and 0 < port < 65536 and port not in ports:
            ports.append(port)
    return ports


def parse_free_port(stdout: str) -> int | None:
    """The port `free_port_script` printed, or None."""
    for line in output_lines(stdout):
        word, _, value = line.partition(" ")
        port = as_int(value) if word == FREE_PORT_MARK else None
        if port is not None and 0 < port < 65536:
            return port
    return None


def marker_pattern(run: Attempt) -> str:
    """A `grep -z` pattern for the environment entry every process of the attempt `run`
    inherits: `RLFLEET_PROGRESS_FILE` in its directory (the launch token makes it unique).
    How a kill finds what the job started outside its process group (`setsid`)."""
    rel = re.escape(run.relative).replace("\\/", "/").replace("\\-", "-")
    return f"^RLFLEET_PROGRESS_FILE=.*/{rel}/"


def marked_kill_lines(
    run: Attempt, signal: str, indent: str = "", *, outside: str | None = None
) -> list[str]:
    """Send `signal` to every process of this VM account whose environment carries the
    attempt's marker (`marker_pattern`): what the job started that left its process group
    (`setsid`, a daemon). With `outside` (a shell word: a process group id), members of
    that group are left alone (they get the group's own signal, once). One `grep` over
    /proc/*/environ (only the account's own processes are readable); a process that
    cleared its environment is not found, and no /proc (not Linux) finds nothing."""
    pattern = shlex.quote(marker_pattern(run))
    skip = []
    if outside is not None:
        # /proc/N/stat: "pid (comm) state ppid pgrp …"; comm may hold spaces and ")".
        skip = [
            f'{indent}  read -r rlfleet_st < "/proc/$rlfleet_m/stat" 2>/dev/null || continue',
            f'{indent}  set -- ${{rlfleet_st##*) }}; [ "$3" = {outside} ] && continue',
        ]
    return [
        f"{indent}for rlfleet_m in $(grep -lzs -e {pattern} /proc/[0-9]*/environ 2>/dev/null); do",
        f"{indent}  rlfleet_m=${{rlfleet_m#/proc/}}; rlfleet_m=${{rlfleet_m%/environ}}",
        *skip,
        f'{indent}  kill -{signal} "$rlfleet_m" 2>/dev/null',
        f"{indent}done",
    ]


def marked_alive(run: Attempt) -> str:
    """A shell condition: some process carrying the attempt's marker still runs."""
    return f"grep -qzs -e {shlex.quote(marker_pattern(run))} /proc/[0-9]*/environ 2>/dev/null"


def pid_check_lines(variable: str) -> list[str]:
    """Empty `$variable` unless it is a plain pid above 1: the pid file is the job's to
    write, and `kill -0 0`, `kill -TERM -1` or `-5` would reach far more than its attempt."""
    return [f'case "${variable}" in ""|*[!0-9]*|0*|1) {variable}= ;; esac']


def watchdog_lines(fence_after_s: float, grace_s: float, run: Attempt | None = None) -> list[str]:
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
    with the group, KILL once the group has ended or its grace has passed.
    """
    if fence_after_s <= 0:
        return ["rlfleet_wd="]
    after = max(1, math.ceil(fence_after_s))
    grace = max(0, math.ceil(grace_s))
    period = int(WATCHDOG_PERIOD_S)
    leftovers = marked_kill_lines(run, "KILL", "  ") if run is not None else ["  :"]
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
        '  f=1; kill -TERM -"$w" 2>/dev/null',
        *(marked_kill_lines(run, "TERM", "  ", outside='"$w"') if run is not None else []),
        "  n=0",
        f'  while [ "$n" -lt {grace} ]; do',
        f'    sleep {period} & s=$!; wait "$s"',
        '    if [ -s "$d/exit_code" ] || ! kill -0 "$w" 2>/dev/null; then'
        " rlfleet_leftovers; exit 0; fi",
        f"    n=$((n + {period}))",
        "  done",
        f'  echo "rlfleet: fenced: still running {grace}s after TERM: KILL"',
        '  [ -e "$d/exit_code" ] || echo 137 > "$d/exit_code"',
        '  kill -KILL -"$w" 2>/dev/null',
        "  rlfleet_leftovers",
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
    # `<>` opens read-write: it creates the file, truncates nothing, and does not wait for
    # a reader when a job made the lease a FIFO.
    return [f'if [ -d "$d" ]; then : 2>/dev/null <>"$d/{LEASE_FILE}"; fi']


def fenced_lines(job_id: int, attempt: int) -> list[str]:
    """Print `rlfleet-fenced <id> <attempt> <why>` if the attempt in `$d` was fenced."""
    j, a = int(job_id), int(attempt)
    return [
        f'if [ -f "$d/{FENCED_FILE}" ] && [ -s "$d/{FENCED_FILE}" ]; then'
        f' echo "{FENCED_MARK} {j} {a}'
        f' $(head -c {FENCED_REASON_BYTES} "$d/{FENCED_FILE}" | tr -d "\\n")"; fi'
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


def launch_script(spec: LaunchSpec, *, pid_wait_s: float = PID_WAIT_S) -> str:
    """Start the attempt detached from the SSH session and print `rlfleet-pid <pid>`.

    Idempotent per attempt directory: `mkdir` of a lock directory is atomic, so only the
    first launch starts a process; a repeated launch waits for that one's pid file and
    reports the same pid. Prints `rlfleet-exited <code>` too when the attempt already ended.
    A kill that came first took the lock and left a `fenced` mark (see `kill_script`):
    then nothing starts and the script exits `FENCED_EXIT`. It also prints
    `rlfleet-dir <absolute directory>`, which the scheduler records for every later script.
    """
    d = spec.run.word()
    polls = max(1, int(pid_wait_s / 0.05))
    return "\n".join(
        [
            f"d={d}",
            'mkdir -p "$d" || exit 97',
            'if mkdir "$d/.launch.lock" 2>/dev/null; then',
            f'  printf "%s" {shlex.quote(wrapper_script(spec))} > "$d/launch.sh" || exit 97',
            *_group_files_lines(spec),
            *_job_env_from_stdin(spec),
            # A clean environment: nothing of the launching shell's but PASSED_ENV.
            f'  setsid {clean_env_words()} sh "$d/launch.sh" </dev/null >>"$d/train.log" 2>&1 &',
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
            f'echo "{PID_MARK} $(head -c {PID_BYTES} "$d/pid" | tr -d "\\n")"',
            f'echo "{DIR_MARK} $(cd "$d" && pwd)"',
            f'if [ -f "$d/exit_code" ] && [ -s "$d/exit_code" ]; then'
            f' echo "{EXITED_MARK} $(head -c {EXIT_CODE_BYTES} "$d/exit_code" | tr -d "\\n")"; fi',
            "",
        ]
    )


def _job_env_from_stdin(spec: LaunchSpec) -> list[str]:
    """Lines of the launch that store its stdin (`job_env_text`) as `job.env`, mode 0600:
    the values never appear on a command line. Nothing is read when the job has none."""
    if not spec.env:
        return []
    return [f'  (umask 077 && cat > "$d/{JOB_ENV_FILE}") || exit 97']


def launch_input(spec: LaunchSpec) -> str | None:
    """What to send on the launch script's stdin: the job's `job.env`, if it has one."""
    return job_env_text(spec.env) if spec.env else None


@dataclass(frozen=True)
class LaunchResult:
    """What the launch script reported: the pid, the exit code if it already ended, and the
    attempt's absolute directory (None if it printed none that names this attempt)."""

    pid: int
    exit_code: int | None = None
    path: str | None = None


def parse_launch(stdout: str, run: Attempt | None = None) -> LaunchResult | None:
    """Read the launch script's output; None when it printed no pid. The directory is kept
    only when it is `run`'s (absolute, ending in its relative path)."""
    pid: int | None = None
    path: str | None = None
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == PID_MARK and as_int(parts[1]) is not None:
            pid = as_int(parts[1])
    if run is not None:
        path = parse_dir(stdout, run)
    return None if pid is None else LaunchResult(pid, parse_exit(stdout), path)


def parse_dir(stdout: str, run: Attempt) -> str | None:
    """The `rlfleet-dir` a script printed, if it is `run`'s directory."""
    for line in output_lines(stdout):
        if line.startswith(DIR_MARK + " "):
            return run.located(line[len(DIR_MARK) + 1 :]).path
    return None


def parse_exit(stdout: str) -> int | None:
    """The `rlfleet-exited <code>` a launch or kill script printed, if any."""
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == EXITED_MARK and as_int(parts[1]) is not None:
            return as_int(parts[1])
    return None


def kill_script(
    run: Attempt,
    grace_s: float = 10.0,
    *,
    pid_wait_s: float = PID_WAIT_S,
    launched: bool = False,
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

    What the job started outside its process group (`setsid`) is found by its environment
    (`marked_kill_lines`) and signalled with the group. The pid file is the job's to write:
    a pid that is not a plausible one (`pid_check_lines`: never `-1`, `0`, `1`) is not
    signalled; an `exit_code` beside a live wrapper (written by someone else) does not stop
    the kill.
    """
    polls = max(1, int(grace_s / 0.1))
    pid_polls = max(1, int(pid_wait_s / 0.05))
    missing = [f'  echo "{KILL_MARK} missing"; exit 0'] if launched else []
    return "\n".join(
        [
            f"d={run.word()}",
            'if [ ! -s "$d/pid" ]; then',
            *missing,
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
            *_read_pid_lines(),
            # The attempt ended (its wrapper is gone): its pid may be someone else's by now.
            # An exit code beside a live wrapper was written by someone else: kill on.
            f'if [ -s "$d/exit_code" ] && ! {{ {_wrapper_alive(run)}; }}; then',
            *marked_kill_lines(run, "KILL", "  "),
            f'  echo "{KILL_MARK} gone";'
            f' echo "{EXITED_MARK} $(head -c {EXIT_CODE_BYTES} "$d/exit_code" | tr -d "\\n")";'
            f' echo "{DIR_MARK} $(cd "$d" && pwd)"; exit 0',
            "fi",
            'if [ -n "$pid" ] && kill -TERM -"$pid" 2>/dev/null; then g=1; else g=; fi',
            # What left the group gets its TERM too (the group's members only the group's).
            *marked_kill_lines(run, "TERM", outside='"$pid"'),
            f'if [ -z "$g" ] && ! {marked_alive(run)}; then echo "{KILL_MARK} gone"; exit 0; fi',
            "n=0",
            f'while {{ [ -n "$g" ] && kill -0 -"$pid" 2>/dev/null; }} || {marked_alive(run)}; do',
            "  n=$((n + 1))",
            f'  if [ "$n" -gt {polls} ]; then',
            '    [ -z "$g" ] || kill -KILL -"$pid" 2>/dev/null',
            *marked_kill_lines(run, "KILL", "    "),
            '    [ -e "$d/exit_code" ] || echo 137 > "$d/exit_code"',
            f'    echo "{KILL_MARK} killed"; exit 0',
            "  fi",
            "  sleep 0.1",
            "done",
            f'echo "{KILL_MARK} terminated"',
            "",
        ]
    )


def _read_pid_lines(variable: str = "pid") -> list[str]:
    """Set `$variable` to the attempt's pid (in `$d`), or empty when its pid file holds no
    plausible pid (`pid_check_lines`)."""
    return [
        # One process, as `cat` was (the substitution drops the trailing newline).
        f'{variable}=$(head -c {PID_BYTES} "$d/pid" 2>/dev/null)',
        *pid_check_lines(variable),
    ]


def _wrapper_alive(run: Attempt, pid: str = "$pid") -> str:
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


ATTEMPT_FILES = frozenset(
    {"train.log", "progress.json", "pid", "exit_code", "launch.sh", "roles.json"}
)
_ROLE_LOG = re.compile(r"[a-z][a-z0-9_]{0,31}\.log")
"""`<role>.log`: the output of one role of a job group (role names as `jobspec.NAME_RE`)."""


def role_log(role: str) -> str:
    """The attempt file holding a job group role's output; `ValueError` for a bad name."""
    name = f"{role}.log"
    if not _ROLE_LOG.fullmatch(name):
        raise ValueError(f"not a role name: {role!r}")
    return name


READ_CHUNK_BYTES = 1 << 20
"""Most bytes one `read_file_script(..., hex=True)` returns; a reader loops for more."""


def read_file_script(
    run: Attempt, name: str, *, offset: int = 0, hex: bool = False, limit: int | None = None
) -> str:
    """Print one file of the attempt directory from byte `offset` (at most `limit` bytes);
    exit 3 if it is missing. With `hex`, the bytes are printed as hex digits (`od`), so
    that a reader gets exactly the bytes written, valid UTF-8 or not (`bytes.fromhex`)."""
    if name not in ATTEMPT_FILES and not _ROLE_LOG.fullmatch(name):
        raise ValueError(f"not an attempt file: {name}")
    command = f'tail -c +{int(offset) + 1} "$f"'
    if limit is not None:
        command += f" | head -c {max(0, int(limit))}"
    if hex:
        command += " | od -An -v -tx1"
    return f'f={run.word()}/{name}; [ -f "$f" ] || exit {NO_FILE_EXIT}; {command}'


TOKENS_MARK = "rlfleet-token"


def tokens_script(installation: str, job_id: int, attempt: int) -> str:
    """Print `rlfleet-token <token>` for each directory of attempt `attempt` of the job
    under this installation (there is one unless the database was restored from a backup):
    how `job logs --attempt N` finds an earlier attempt, whose token the job row no longer
    holds. Other installations' directories are never listed."""
    base = home_path(job_base(installation, job_id))
    return (
        f"for p in {base}/{int(attempt)}-*; do "
        f'[ -d "$p" ] && echo "{TOKENS_MARK} ${{p##*-}}"; done; true'
    )


def parse_tokens(stdout: str) -> list[str]:
    """The well-formed tokens `tokens_script` printed."""
    found = []
    for line in output_lines(stdout):
        parts = line.split()
        if len(parts) == 2 and parts[0] == TOKENS_MARK and _TOKEN.fullmatch(parts[1]):
            found.append(parts[1])
    return found


# --- job status probe (docs/invariants.md, contract 2), run by the poller in the same round trip
# as nvidia-smi

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


@dataclass(frozen=True)
class ProgressPoint:
    """The training step an attempt has reached, with its reward and loss (for the curves)."""

    step: int
    reward: float | None = None
    loss: float | None = None


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


def status_probe(jobs: Sequence[Attempt]) -> str:
    """Shell text printing one `rlfleet-job <id> <attempt> <state> [code]` line per attempt.

    An exited attempt is followed by the end of its train.log (its last `LOG_TAIL_BYTES`),
    each line prefixed with `rlfleet-log <id> <attempt> `, and by a `rlfleet-cannot-start`
    line when the wrapper's own check failed. Each probe renews the attempt's lease, and
    reports a fenced attempt with a `rlfleet-fenced` line.

    Every file here is the job's to write (docs/invariants.md, invariant 9), so each is
    read with a byte bound (`head -c`, `tail -c`: a sparse 10 GB log without newlines costs
    what 4 KB does), only when it is a regular file (a FIFO would block the read), and
    nothing in them is trusted: the attempt runs while its wrapper (the pid in `pid`, a
    live process whose command line is this attempt's `launch.sh`) runs, whatever
    `exit_code` says, so an exit code written by someone else beside a live wrapper is
    not taken. Only once the wrapper is gone is `exit_code` read; the wrapper writes it
    just before it exits, so it is there by then.
    """
    lines = []
    for run in jobs:
        j, a = int(run.job_id), int(run.attempt)
        lines += [f"d={run.word()}", *lease_touch_lines(), *fenced_lines(j, a)]
        lines += [
            "s=unknown; p=",
            'if [ -f "$d/pid" ] && [ -s "$d/pid" ]; then',
            *("  " + line for line in _read_pid_lines("p")),
            "fi",
            'if [ -n "$p" ] && kill -0 "$p" 2>/dev/null'
            # A zombie answers kill -0 but is dead (its reaper may be slow or absent).
            " && ! { [ -r /proc/$p/stat ] && cut -d')' -f2- /proc/$p/stat | grep -q '^ Z'; };"
            " then",
            # Alive; with an exit code beside it, only the wrapper itself counts as running
            # (its pid may have been reused since it ended).
            f'  if [ -s "$d/exit_code" ] && ! {{ {_wrapper_alive(run, "$p")}; }};'
            " then s=exited; else s=running; fi",
            'elif [ -f "$d/exit_code" ] && [ -s "$d/exit_code" ]; then s=exited',
            'elif [ -e "$d/pid" ]; then s=vanished',
            "fi",
            'if [ "$s" = exited ]; then',
            f'  echo "{STATUS_MARK} {j} {a} exited'
            f' $(head -c {EXIT_CODE_BYTES} "$d/exit_code" 2>/dev/null | tr -d "\\n")"',
            f'  if [ -e "$d/{CANNOT_START_FILE}" ]; then echo "{CANNOT_START_MARK} {j} {a}"; fi',
            f'  if [ -f "$d/train.log" ]; then tail -c {LOG_TAIL_BYTES} "$d/train.log"'
            f' | sed "s/^/{LOG_MARK} {j} {a} /"; fi',
            "  echo",
            f'else echo "{STATUS_MARK} {j} {a} $s"; fi',
            # One line: the JSON's own newlines are only whitespace between its tokens.
            f'if [ -f "$d/progress.json" ] && [ -s "$d/progress.json" ]; then'
            f' printf "%s " "{PROGRESS_MARK} {j} {a}";'
            f' head -c {PROGRESS_BYTES} "$d/progress.json" 2>/dev/null | tr -d "\\n\\r"; echo; fi',
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
    for line in output_lines(stdout):
        if line.startswith(CANNOT_START_MARK + " "):
            ids = [as_int(p) for p in line.split()[1:]]
            if len(ids) == 2 and ids[0] is not None and ids[1] is not None:
                cannot_start.add((ids[0], ids[1]))
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
            states[(job_id, attempt)] = ("exited", code) if code is not None else ("unknown", None)
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
        )
        for key, (state, code) in states.items()
    }


def log_tail(lines: Sequence[str]) -> str:
    """The last `LOG_TAIL_LINES` lines of what the probe read of a log, printable (no NUL or
    other control character: it may end up in a reason or on a terminal)."""
    return printable("\n".join(lines[-LOG_TAIL_LINES:]))
