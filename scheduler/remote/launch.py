"""Launching an attempt: `LaunchSpec` (everything a launch needs), the training
command (docs/invariants.md, contract 5), the `launch.sh` wrapper that runs it detached
with its pid, exit code and watchdog, and the launch script with its output
(`launch_script`, `parse_launch`).

Every value that could come from a user (model, dataset, reward names, extra args, paths)
goes through `shlex.quote` (docs/invariants.md, invariant 5); the job's environment is
applied only in the subshell that execs the training.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.remote import cgroup, jobuser
from scheduler.remote.env import (
    JOB_ENV_FILE,
    VM_ENV_FILE,
    clean_env_words,
    job_env_text,
    load_env_lines,
)
from scheduler.remote.isolated import ENTRY_CHECK_CODE, isolated_words
from scheduler.remote.kill import PID_WAIT_S
from scheduler.remote.layout import DIR_MARK, PRIVATE_TREE, Attempt, home_path, parse_dir
from scheduler.remote.output import (
    EXIT_CODE_BYTES,
    EXITED_MARK,
    PID_BYTES,
    as_int,
    output_lines,
    parse_exit,
)
from scheduler.remote.rendezvous import GroupLaunch, RankRendezvous, rendezvous_env
from scheduler.remote.store import (
    finish_lines,
    restore_lines,
    store_error_lines,
    watch_start_lines,
)
from scheduler.remote.watchdog import (
    DEFAULT_FENCE_AFTER_S,
    DEFAULT_FENCE_GRACE_S,
    watchdog_lines,
    watchdog_stop_lines,
)
from scheduler.remote.workdir import WORK_DIR, copy_lines

PID_MARK = "rlfleet-pid"
FENCED_EXIT = 96
"""Exit status of the launch script when a kill fenced the attempt off before it started."""


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
    node: RankRendezvous | None = None
    """This rank's place in a multi-node job; None for a single-node job."""
    group: GroupLaunch | None = None
    """The roles this VM runs for a job group (the supervisor replaces the training
    command); None for a job of one training role."""
    workdir: str | None = None
    """The digest of the job's workdir (`job submit --workdir`), cached on the VM under the
    installation's directory: the launch copies it into the attempt's `work/`, which the
    attempt runs in and has first on PYTHONPATH; None for a job without one."""
    store: str | None = None
    """The job's store URL (`scheduler.store`): checkpoints are restored before training
    and uploaded beside it (`scheduler.remote.store`); None: no store."""
    store_accept: Sequence[str] = ()
    """The store content the job's attempts reported (`scheduler.store.binding.Accepted.
    words`, from Postgres): all the store agents take for the job's."""
    job_user: str | None = None
    """The VM's job user (`scheduler.remote.jobuser`): the training runs as this account;
    None: as the VM account the scheduler logs in as."""

    @property
    def uploads(self) -> bool:
        """Whether this node uploads to the store (rank 0 of a job with one)."""
        return self.store is not None and (self.node is None or self.node.rank == 0)


def entry_words(
    python: str, entrypoint: str, num_gpus: int, node: RankRendezvous | None = None
) -> list[str]:
    """How training starts on the VM (docs/invariants.md, contract 5), as quoted shell
    words: `launcher_argv`, each word quoted."""
    return [shlex.quote(word) for word in launcher_argv(python, entrypoint, num_gpus, node)]


def launcher_argv(
    python: str, entrypoint: str, num_gpus: int, node: RankRendezvous | None = None
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


def entry_check_words(python: str, entrypoint: str, work: str = "''") -> list[str]:
    """A command that exits 0 when the VM can start training: `python` runs and finds
    `entrypoint` (a readable `.py` script, or an importable module) in the VM's own
    installation, or the job's workdir (`work`, a shell word; `''`: none) ships it;
    otherwise its last line of output says why. It runs isolated
    (`remote.isolated.ENTRY_CHECK_CODE`): nothing of the job's is imported."""
    return isolated_words(python, ENTRY_CHECK_CODE, [shlex.quote(entrypoint), work], vm_path=True)


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
    the training (`watchdog_lines`) and is stopped the moment the training ends. Where the
    VM gives one, the wrapper moves into a cgroup of the attempt's own before it starts
    anything, and kills what is left in it when the training ends (`remote.cgroup`).

    The job's environment (the VM's env file, then the job's `job.env`) is loaded only in
    the subshell that execs the training, after the scheduler's variables and the training
    command are set there: no variable of the job reaches the wrapper's own (`d`,
    `rlfleet_sig`, `rlfleet_wd`, `PATH`…), so a job cannot redirect its exit code, fake a
    signal or make the wrapper's check of python fail (docs/invariants.md, invariant 9).
    Only that check (run with the VM's env file, not the job's) says the VM cannot run
    training: it writes `CANNOT_START_FILE`; any exit code of the training itself, 126 and
    127 included, is the job's. The wrapper, its check and the store agent run in the
    attempt directory, as isolated Python (`remote.isolated`): a workdir shipping
    `training/`, `scheduler/` or `json.py` is imported by the training alone, which runs
    in the workdir with it first on PYTHONPATH.
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
            # The attempt's cgroup (`remote.cgroup`): made first, entered once the watchdog
            # (which must stay outside to stop it) runs, before anything else starts; a
            # job user's processes (started by sudo from here) are in it too, and the
            # cgroup stays the scheduler account's.
            *cgroup.setup_lines(spec.run),
            *watchdog_lines(spec.fence_after_s, spec.fence_grace_s, spec.run, spec.job_user),
            *cgroup.enter_lines(),
            *jobuser.setup_lines(
                spec.job_user, home_path(spec.output_dir), WORK_DIR if spec.workdir else None
            ),
            *jobuser.group_lines(
                spec.job_user, spec.group.config if spec.group else None, GROUP_FILE
            ),
            # The wrapper and its helpers run in the attempt directory, never in the job's
            # workdir (and isolated: `remote.isolated`); only the training goes there.
            'cd "$d" || exit 1',
            'echo "rlfleet: attempt started on $(hostname) at $(date -u +%FT%TZ)'
            f' CUDA_VISIBLE_DEVICES="{shlex.quote(visible_devices(spec))}',
            # A python or entrypoint the VM cannot run ends the attempt with 127 and one
            # line saying why, before training starts (the poller marks the VM). The check
            # sees the VM's env file (a PATH, a PYTHONPATH set there), never the job's own
            # variables, and runs isolated: it imports nothing of the job's workdir.
            "rlfleet_check=$(",
            *jobuser.failed_lines(spec.job_user),
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
            *("  " + line for line in _store_before(spec)),
            *jobuser.restored_lines(spec.job_user, spec.store, home_path(spec.output_dir)),
            # The training in a subshell: the command and the scheduler's variables first
            # (the loader skips their names), then the job's environment, then exec.
            "  (",
            "  set -- " + " ".join(command),
            f"  export CUDA_VISIBLE_DEVICES={shlex.quote(visible_devices(spec))}",
            f"  export CUDA_DEVICE_ORDER={DEVICE_ORDER}",
            f"  export RLFLEET_PROGRESS_FILE={jobuser.progress_dir(spec.job_user)}/progress.json",
            f"  export RLFLEET_JOB_ID={int(spec.job_id)} RLFLEET_ATTEMPT={int(spec.attempt)}",
            *("  " + line for line in rendezvous_lines(spec)),
            *("  " + line for line in jobuser.env_lines(spec.job_user)),
            *("  " + line for line in workdir_env_lines(spec, before_env=True)),
            *load_env_lines([home_path(VM_ENV_FILE), f'"$d/{JOB_ENV_FILE}"']),
            *("  " + line for line in workdir_env_lines(spec, before_env=False)),
            *("  " + line for line in _cd_lines(spec)),
            *jobuser.exec_lines(spec.job_user, spec.python),
            "  )",
            "  rc=$?",
            *("  " + line for line in _store_after(spec)),
            # Only the check above may say the VM cannot start training, not the job.
            f'  rm -f "$d/{CANNOT_START_FILE}"',
            "fi",
            *watchdog_stop_lines(),
            *cgroup.leave_lines(),
            *(store_error_lines() if spec.store is not None else []),
            'echo "$rc" > "$d/exit_code.tmp" && mv -f "$d/exit_code.tmp" "$d/exit_code"',
            'echo "rlfleet: attempt ended with exit code $rc"',
            "",
        ]
    )


def _cd_lines(spec: LaunchSpec) -> list[str]:
    """Where the training runs (in its subshell, just before it starts): its copy of the
    job's workdir, or the VM user's home. A job group's supervisor stays in the attempt
    directory, where the wrapper's own helpers run (`remote.isolated`); it starts each
    role in the workdir itself."""
    if spec.group is not None:
        return []
    if spec.workdir is None:
        return jobuser.cd_lines(spec.job_user)
    return [f'cd "$d/{WORK_DIR}" || exit 1']


def workdir_env_lines(spec: LaunchSpec, *, before_env: bool) -> list[str]:
    """For a job with a workdir: `RLFLEET_WORKDIR` (before the env files, which cannot set
    it), then, after them, the workdir put first on the PYTHONPATH they may have set."""
    if spec.workdir is None:
        return []
    if before_env:
        return [f'export RLFLEET_WORKDIR="$d/{WORK_DIR}"']
    return ['export PYTHONPATH="$RLFLEET_WORKDIR${PYTHONPATH:+:$PYTHONPATH}"']


def _store_before(spec: LaunchSpec) -> list[str]:
    """With a store: restore, then (rank 0) start the uploader; the training below runs
    only when `rlfleet_skip` is unset (it is wrapped in an `if` here)."""
    if spec.store is None:
        return []
    accept = spec.store_accept
    lines = restore_lines(spec.python, spec.store, spec.run, spec.output_dir, accept)
    if spec.uploads:
        lines += [
            'if [ -z "${rlfleet_skip:-}" ]; then',
            *watch_start_lines(spec.python, spec.store, spec.run, spec.output_dir, accept),
            "fi",
        ]
    return [*lines, 'if [ -z "${rlfleet_skip:-}" ]; then']


def _store_after(spec: LaunchSpec) -> list[str]:
    """With a store: (rank 0) stop the uploader and upload the rest, the final outputs
    after an exit 0; closes the `if` of `_store_before`."""
    if spec.store is None:
        return []
    if not spec.uploads:
        return ["fi"]
    accept = spec.store_accept
    return [*finish_lines(spec.python, spec.store, spec.run, spec.output_dir, accept), "fi"]


SUPERVISOR_FILE = "supervisor.py"
GROUP_FILE = "group.json"


def _check_words(spec: LaunchSpec) -> list[str]:
    """The wrapper's check that training can start (`entry_check_words`, with the job's
    workdir when it has one), or only that the VM's python runs, for a group without a
    training role; isolated either way."""
    if spec.group is not None and not spec.group.needs_entrypoint:
        return isolated_words(spec.python, "pass")
    work = f'"$d/{WORK_DIR}"' if spec.workdir is not None else "''"
    return entry_check_words(spec.python, spec.entrypoint, work)


def supervisor_words(spec: LaunchSpec) -> list[str]:
    """The command of a job group's attempt: the supervisor with its `group.json`, isolated
    (standard library only: it needs no PYTHONPATH, and the job's is ignored)."""
    group = jobuser.group_file_word(spec.job_user, GROUP_FILE)
    return [shlex.quote(spec.python), "-I", "-u", f'"$d/{SUPERVISOR_FILE}"', group]


def supervisor_source() -> str:
    """The text of `scheduler/supervisor.py`, shipped into each group attempt directory."""
    from pathlib import Path

    return (Path(__file__).parent.parent / "supervisor.py").read_text(encoding="utf-8")


def _group_files_lines(spec: LaunchSpec) -> list[str]:
    """Lines of the launch that write the supervisor and its `group.json` (none for a job
    of one training role)."""
    if spec.group is None:
        return []
    return [
        f'  printf "%s" {shlex.quote(supervisor_source())} > "$d/{SUPERVISOR_FILE}" || exit 97',
        f'  printf "%s" {shlex.quote(spec.group.text())} > "$d/{GROUP_FILE}" || exit 97',
    ]


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
            PRIVATE_TREE,
            'mkdir -p "$d" || exit 97',
            'if mkdir "$d/.launch.lock" 2>/dev/null; then',
            f'  printf "%s" {shlex.quote(wrapper_script(spec))} > "$d/launch.sh" || exit 97',
            *_group_files_lines(spec),
            *(copy_lines(spec.run.installation, spec.workdir) if spec.workdir else []),
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
