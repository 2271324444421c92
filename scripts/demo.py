"""`make demo`: train a tiny model with GRPO through the whole scheduler, on this machine.

1. starts `rlfleet up --local-vm --gpus 1` in the background (embedded Postgres and NATS,
   the three daemons, this machine as a VM with one simulated GPU: training runs on CPU);
2. builds a tiny random model (`python -m training.tiny_model`);
3. submits a GRPO job with `rlfleet job submit` (reward: say the keyword "hello");
4. shows the job moving through its states and its training progress;
5. prints where the trained model is and the mean reward at the start and at the end;
6. stops everything, whatever happened (the `up` process group is killed in a finally).

Everything lives in .demo/<time>/ (the state dir, the VM's home with the job's logs and
outputs, the tiny model, up.log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "training" / "data" / "arithmetic.jsonl"
FINAL = {"completed", "failed", "cancelled"}

# The setup tests/training/test_learning.py proves reaches a mean reward >= 0.9 on 2 CPUs.
TRAIN_ARGS = [
    "--keywords", "hello",
    "--learning_rate", "3e-3",
    "--num_generations", "8",
    "--per_device_train_batch_size", "8",
    "--max_completion_length", "16",
    "--save_steps", "1000",
    "--seed", "0",
]  # fmt: skip


def say(message: str) -> None:
    """One line of the demo's story, timestamped from the start."""
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", flush=True)


STARTED = time.monotonic()


def rlfleet_cmd() -> list[str]:
    """The rlfleet CLI of this environment."""
    script = Path(sys.executable).parent / "rlfleet"
    return [str(script)] if script.exists() else [sys.executable, "-m", "scheduler.cli"]


def rlfleet(env: dict[str, str], *args: str, check: bool = True) -> str:
    """Run `rlfleet ARGS` and return its stdout; a failure shows its stderr."""
    proc = subprocess.run(
        [*rlfleet_cmd(), *args], env=env, capture_output=True, text=True, timeout=120
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"rlfleet {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def wait_until_up(up: subprocess.Popen[bytes], state_dir: Path, log: Path, timeout: float) -> dict:
    """Wait for `up` to say it is ready in up.json; fail with its log if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"rlfleet up exited with {up.returncode}:\n{tail(log, 30)}")
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((state_dir / "up.json").read_text())
            if data.get("ready") and data.get("pid") == up.pid:
                return data
        time.sleep(0.3)
    raise RuntimeError(f"rlfleet up was not ready after {timeout:.0f}s:\n{tail(log, 30)}")


def tail(path: Path, lines: int) -> str:
    """The last lines of a text file ('' when missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file, or None while it is missing or half written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# The trainer logs dicts like {'loss': '0.01', 'reward': '0.05', …} (values may be quoted).
REWARD_RE = re.compile(r"['\"]reward['\"]:\s*['\"]?(?:np\.float64\()?([-+0-9.eE]+)")


def rewards_from_log(log: Path) -> list[float]:
    """The mean reward of each logging step, from the trainer's log lines in train.log."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [float(m) for m in REWARD_RE.findall(text)]


def stop_up(up: subprocess.Popen[bytes], state_dir: Path) -> None:
    """SIGTERM the `up` process group (a clean stop), SIGKILL it after a grace period, and
    make sure no server it started outlives it."""
    if up.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
    # The servers run in sessions of their own; a clean stop stopped them, a killed `up`
    # did not: up.json still names them then.
    state = read_json(state_dir / "up.json") or {}
    for pid in (state.get("server_pids") or {}).values():
        if isinstance(pid, int) and pid > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 when the job completed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=60, help="GRPO steps (default 60)")
    parser.add_argument("--dir", type=Path, help="Where to keep everything (default .demo/<time>)")
    parser.add_argument("--timeout", type=float, default=1200, help="Give up after this long")
    args = parser.parse_args(argv)
    # Ctrl-C and SIGTERM both end in the `finally` that stops everything (a shell may
    # have started us with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)

    base = (args.dir or REPO / ".demo" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    state_dir, home, model_dir, up_log = (
        base / "state",
        base / "home",
        base / "tiny-model",
        base / "up.log",
    )
    home.mkdir(parents=True, exist_ok=True)
    say(f"rlfleet demo: everything goes to {base}")

    # The local VM's home is the demo's own, so the job's logs and outputs land there.
    env = {
        **os.environ,
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "RLFLEET_LOG_LEVEL": "INFO",
    }
    env.pop("RLFLEET_DATABASE_URL", None)
    env.pop("RLFLEET_NATS_URL", None)
    # Jobs start with a clean environment: what they need comes from the VM's env file.
    vm_env = home / ".rlfleet" / "env"
    vm_env.parent.mkdir(parents=True, exist_ok=True)
    vm_env.touch(mode=0o600)
    vm_env.write_text(
        "HF_HUB_OFFLINE=1\nHF_DATASETS_OFFLINE=1\nTOKENIZERS_PARALLELISM=false\nPYTHONUNBUFFERED=1\n"
    )
    say("starting `rlfleet up --local-vm --gpus 1` (embedded Postgres + NATS, 3 daemons)")
    with up_log.open("ab") as log_handle:
        up = subprocess.Popen(
            [*rlfleet_cmd(), "up", "--state-dir", str(state_dir), "--local-vm", "--gpus", "1"],
            env=env,
            cwd=REPO,
            stdout=log_handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    job_id: int | None = None
    cli_env = dict(env)
    status = "?"
    try:
        say("building the tiny model (python -m training.tiny_model) meanwhile")
        subprocess.run(
            [sys.executable, "-m", "training.tiny_model", str(model_dir)],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=300,
        )
        wait_until_up(up, state_dir, up_log, timeout=180)
        from scheduler.up import read_env_file

        # The credentials are in the env file `up` wrote (mode 0600), as a shell would source.
        cli_env.update(read_env_file(state_dir / "env"))
        say("rlfleet is up:")
        print(f"    source {state_dir / 'env'}", flush=True)
        submit = [
            "job", "submit",
            "--model", str(model_dir),
            "--dataset", str(DATASET),
            "--reward-function", "keyword_match",
            "--name", "demo-keyword",
            "--max-retries", "1",
            "--", "--max_steps", str(args.max_steps),
            # Every 5 steps (a mean over 40 answers), fewer for a very short run.
            "--logging_steps", str(max(1, min(5, args.max_steps // 2))),
            *TRAIN_ARGS,
        ]  # fmt: skip
        say("$ rlfleet " + " ".join(submit))
        job_id = int(rlfleet(cli_env, *submit).strip())
        say(f"submitted job {job_id}")
        status = follow(cli_env, job_id, home, args.timeout)
        return report(cli_env, job_id, status, home)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - the demo explains, then cleans up
        say(f"demo failed: {exc}")
        print(f"--- last lines of {up_log}:\n{tail(up_log, 20)}", flush=True)
        return 1
    finally:
        if job_id is not None and status not in FINAL and cli_env.get("RLFLEET_DATABASE_URL"):
            say(f"cancelling job {job_id}")
            with contextlib.suppress(Exception):
                rlfleet(cli_env, "job", "cancel", str(job_id), check=False)
            # The VM is this machine: make sure no training process outlives the demo.
            kill_job_processes(home, job_id)
        say("stopping rlfleet up")
        stop_up(up, state_dir)
        say(f"done; everything stopped (logs: {up_log})")


def kill_job_processes(home: Path, job_id: int, grace_s: float = 10.0) -> None:
    """TERM, then KILL, the process group of every attempt of the job on the local VM."""
    groups = []
    for pid_file in (home / ".rlfleet").glob(f"*/jobs/{int(job_id)}/*/pid"):
        with contextlib.suppress(OSError, ValueError):
            groups.append(int(pid_file.read_text().strip()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
                alive.append(pgid)
        if not alive:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_group_alive(g) for g in alive):
            time.sleep(0.2)
        groups = [g for g in alive if _group_alive(g)]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def attempt_dir(home: Path, job: dict[str, Any]) -> Path | None:
    """The job's current attempt directory on the local VM (docs/invariants.md, contract 1), as its
    launch
    recorded it; None before the launch."""
    recorded = job.get("attempt_dir")
    return resolve_on_vm(home, recorded) if recorded else None


def follow(env: dict[str, str], job_id: int, home: Path, timeout: float) -> str:
    """Print each state change and the training progress until the job ends."""
    deadline = time.monotonic() + timeout
    seen_events = 0
    last_progress = None
    while time.monotonic() < deadline:
        job = json.loads(rlfleet(env, "job", "show", str(job_id), "--json"))
        for event in job.get("events", [])[seen_events:]:
            reason = f" ({event['reason']})" if event.get("reason") else ""
            where = f" on {job['vm']} GPU {job['gpu_indices']}" if event["to"] == "running" else ""
            say(f"job {job_id}: {event['from'] or 'new'} -> {event['to']}{where}{reason}")
        seen_events = len(job.get("events", []))
        run_dir = attempt_dir(home, job)
        progress = read_json(run_dir / "progress.json") if run_dir else None
        if progress and progress.get("step") != last_progress:
            last_progress = progress.get("step")
            reward = progress.get("reward")
            shown = "-" if reward is None else f"{reward:.3f}"
            eta = progress.get("eta_s")
            say(
                f"job {job_id}: step {progress.get('step')}/{progress.get('max_steps')}, "
                f"mean reward {shown}" + (f", ~{eta:.0f}s left" if eta else "")
            )
        if job["status"] in FINAL:
            return str(job["status"])
        time.sleep(1.0)
    raise RuntimeError(f"job {job_id} did not finish within {timeout:.0f}s")


def resolve_on_vm(home: Path, path: str) -> Path:
    """A path as the local VM's shell sees it: `~` and relative paths are under its home."""
    if path.startswith("~/"):
        return home / path[2:]
    return Path(path) if path.startswith("/") else home / path


def report(env: dict[str, str], job_id: int, status: str, home: Path) -> int:
    """Print where the model is and how the reward moved; 0 when the job completed."""
    job = json.loads(rlfleet(env, "job", "show", str(job_id), "--json"))
    run_dir = attempt_dir(home, job) or home
    if status != "completed":
        say(f"job {job_id} ended {status}: {job.get('failure_reason')} {job.get('status_reason')}")
        print(f"--- {run_dir / 'train.log'}:\n{tail(run_dir / 'train.log', 20)}", flush=True)
        return 1
    output = resolve_on_vm(home, job["output_dir"])
    rewards = rewards_from_log(run_dir / "train.log")
    progress = read_json(run_dir / "progress.json") or {}
    first = rewards[0] if rewards else None
    last = rewards[-1] if rewards else progress.get("reward")
    print("", flush=True)
    say(f"job {job_id} completed after {job.get('attempt')} attempt(s)")
    print(f"    trained model: {output}", flush=True)
    print(f"    training log:  {run_dir / 'train.log'}", flush=True)
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(
        f"    mean reward (keyword 'hello'): start {fmt(first)} -> end {fmt(last)} "
        f"over {progress.get('step', '?')} GRPO steps",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
