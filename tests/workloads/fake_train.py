"""A stand-in for train_grpo.py in scheduler tests (docs/invariants.md, contract 4): cheap, no
torch.

It accepts and ignores train_grpo.py's flags and obeys a few of its own:
`--fake_seconds S` sleeps (`--fake_retry_seconds S` instead on attempts after the first),
`--fake_exit N` exits with N, `--fake_oom_once` fails with a
CUDA out-of-memory error (exit 75) on the first attempt only (a marker file in
`--output_dir` remembers it); `--fake_fail_rank R` makes those two apply on node rank R of
a multi-node job only, at once (no sleep), the other ranks running normally;
`--fake_hostile` writes hostile files into its attempt directory instead of its progress
(`hostile`: what a job may write there must cost only that job); `--fake_setsid_child`
starts a `sleep` in a session of its own (outside the attempt's process group) and writes
its pid to `setsid_child.pid` in `--output_dir`; `--fake_escape_child` starts one that
double-forks, calls setsid, clears its environment (`env -i`) and ignores TERM, pid in
`escape_child.pid`; `--fake_ignore_term` ignores SIGTERM (only a KILL stops it);
`--fake_hang_at N` stops advancing after
step N (0: before the first) and waits for ever (`--fake_hang_once`: on the first attempt
only); `--fake_step_seconds S` takes S seconds per step; `--fake_checkpoints` writes a
`checkpoint-<step>` directory (with a `trainer_state.json`) in `--output_dir` at each step,
and with `--resume auto` starts after the newest one; `--fake_fence_note BYTES` writes that
much garbage into its attempt's `fenced_reason` (the watchdog's note) before it trains;
`--fake_block_final DIR` puts a file
named `final` at `DIR/<job id>/` (its place in a `file://` store whose installation
directory is DIR), and a model file in `--output_dir`: the store then refuses its final
upload. It writes
progress.json to $RLFLEET_PROGRESS_FILE and, when `RLFLEET_FAKE_RECORD` names a
directory, one JSON line per run there saying where, as which rank and on which GPUs it
ran, so tests can prove that no GPU was shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse the flags this stand-in obeys; every other flag is accepted and ignored."""
    parser = argparse.ArgumentParser(prog="fake_train")
    parser.add_argument("--output_dir", default=".")
    parser.add_argument("--fake_seconds", type=float, default=0.0)
    parser.add_argument("--fake_retry_seconds", type=float, default=None)
    parser.add_argument("--fake_exit", type=int, default=0)
    parser.add_argument("--fake_oom_once", action="store_true")
    parser.add_argument("--fake_fail_rank", type=int, default=None)
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--fake_hostile", action="store_true")
    parser.add_argument("--fake_setsid_child", action="store_true")
    parser.add_argument("--fake_escape_child", action="store_true")
    parser.add_argument("--fake_ignore_term", action="store_true")
    parser.add_argument("--fake_hang_at", type=int, default=None)
    parser.add_argument("--fake_hang_once", action="store_true")
    parser.add_argument("--fake_step_seconds", type=float, default=None)
    parser.add_argument("--fake_checkpoints", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--fake_fence_note", type=int, default=None)
    parser.add_argument("--fake_block_final", default=None)
    args, _unknown = parser.parse_known_args(argv)
    rank = os.environ.get("RLFLEET_NODE_RANK")
    if args.fake_fail_rank is None:
        return args
    if rank == str(args.fake_fail_rank):
        args.fake_seconds = args.fake_retry_seconds = 0.0  # fails while the others train
    else:
        args.fake_exit, args.fake_oom_once = 0, False  # trains until the other fails it
    return args


def write_progress(step: int, max_steps: int, status: str) -> None:
    """Write progress.json atomically, the way training.progress does."""
    path = os.environ.get("RLFLEET_PROGRESS_FILE")
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        # A reward that rises and a loss that falls, as a run that learns draws them.
        data = {"status": status, "step": step, "max_steps": max_steps}
        data.update(reward=round(step / max_steps, 3), loss=round(1.0 / (step + 1), 3))
        json.dump(data, handle)
    os.replace(tmp, path)


HOSTILE_PROGRESS = (
    b"[" * 2040,  # json.loads: RecursionError
    b'{"step": ' + b"9" * 5000 + b"}",  # more digits than int() converts
    b'{"step": 3, "status": "\xff\xfe\x00\x1b[2J"}',  # invalid UTF-8, NUL, an escape
    b'{"step": 4, "loss": NaN, "reward": Infinity, "eta_s": -Infinity}',
    bytes(range(256)) * 4,  # binary
)
HOSTILE_EXIT_CODES = (b"garbage\n", b"9" * 30 + b"\n", b"0\n")
SPARSE_LOG_BYTES = 100 << 30
"""The size the hostile job gives its train.log: sparse (no disk used), no newline."""


def hostile(seconds: float) -> None:
    """Write, one after the other over `seconds`, what a hostile job may write into its
    attempt directory: progress.json that cannot be parsed (nested 2,040 deep, a 5,000-digit
    number, invalid UTF-8, NaN, binary), exit_code garbage (words, a 30-digit number, a
    forged 0 while it still runs), and last a sparse 100 GB train.log without a newline.
    Ends with the deepest progress.json in place."""
    directory = Path(os.environ["RLFLEET_PROGRESS_FILE"]).parent
    pause = seconds / (len(HOSTILE_PROGRESS) + len(HOSTILE_EXIT_CODES) + 1)
    for data in HOSTILE_PROGRESS:
        (directory / "progress.json").write_bytes(data)
        time.sleep(pause)
    for data in HOSTILE_EXIT_CODES:
        (directory / "exit_code").write_bytes(data)
        time.sleep(pause)
    (directory / "progress.json").write_bytes(HOSTILE_PROGRESS[0])
    sys.stdout.flush()
    os.truncate(directory / "train.log", SPARSE_LOG_BYTES)
    time.sleep(pause)


def setsid_child(output_dir: Path) -> None:
    """Start a `sleep` that leaves the attempt's process group (a session of its own), as
    a careless or hostile job may, and say its pid in `setsid_child.pid`."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (output_dir / "setsid_child.pid").write_text(f"{child.pid}\n")


def escape_child(output_dir: Path) -> None:
    """Start a `sleep` that does all a process can to leave its attempt: a double fork, a
    session of its own, an empty environment (no marker), TERM ignored; its pid in
    `escape_child.pid`."""
    import subprocess

    pid_file = output_dir / "escape_child.pid"
    inner = 'trap "" TERM; echo "$$" > "$1.tmp" && mv "$1.tmp" "$1"; exec /bin/sleep 1000'
    outer = f'(setsid env -i /bin/sh -c {shlex.quote(inner)} sh "$1" </dev/null >/dev/null 2>&1 &)'
    subprocess.run(["/bin/sh", "-c", outer, "sh", str(pid_file)], check=True)
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def hang() -> None:
    """Stop advancing, alive, as a trainer stuck in a collective does."""
    print("fake_train: waiting for a peer that never comes", flush=True)
    record("hang")
    time.sleep(3600)


def record(event: str, **fields: object) -> None:
    """Append one line to the run record, when the test asked for one."""
    folder = os.environ.get("RLFLEET_FAKE_RECORD")
    if not folder:
        return
    line = {
        "event": event,
        "vm": os.environ.get("RLFLEET_SIM_VM", ""),
        "job_id": os.environ.get("RLFLEET_JOB_ID"),
        "attempt": os.environ.get("RLFLEET_ATTEMPT"),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "num_processes": os.environ.get("RLFLEET_FAKE_NUM_PROCESSES"),
        "node_rank": os.environ.get("RLFLEET_NODE_RANK"),
        "pid": os.getpid(),
        "t": time.time(),
        **fields,
    }
    with open(Path(folder) / f"{line['vm']}-{line['job_id']}-{line['attempt']}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Pretend to train; return the exit code asked for."""
    args = parse(sys.argv[1:] if argv is None else argv)
    print(f"fake_train: args={sys.argv[1:]}", flush=True)
    print(f"fake_train: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    if os.environ.get("RLFLEET_NODE_RANK") is not None:
        names = ("RLFLEET_NODE_RANK", "RLFLEET_NUM_NODES", "RLFLEET_GPUS_PER_NODE")
        names += ("RLFLEET_NODE_ADDRS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
        node = " ".join(f"{n}={os.environ.get(n)}" for n in names)
        print(f"fake_train: node {node}", flush=True)
    record("start")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.fake_oom_once and not (out / ".fake_oom_done").exists():
        (out / ".fake_oom_done").write_text("1")
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        record("end", exit_code=75)
        return 75
    seconds = args.fake_seconds
    if args.fake_retry_seconds is not None and os.environ.get("RLFLEET_ATTEMPT", "1") != "1":
        seconds = args.fake_retry_seconds
    if args.fake_setsid_child:
        setsid_child(out)
    if args.fake_fence_note is not None:
        note = Path(os.environ["RLFLEET_PROGRESS_FILE"]).parent / "fenced_reason"
        garbage = b"garbage \xff\x00 " * (args.fake_fence_note // 13 + 1)
        note.write_bytes(garbage[: args.fake_fence_note])
    if args.fake_block_final:
        place = Path(args.fake_block_final) / os.environ.get("RLFLEET_JOB_ID", "0")
        place.mkdir(parents=True, exist_ok=True)
        (place / "final").write_text("not a directory\n")
        (out / "model.safetensors").write_bytes(b"weights")
    if args.fake_escape_child:
        escape_child(out)
    if args.fake_ignore_term:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.fake_hostile:
        hostile(seconds)
        record("end", exit_code=args.fake_exit)
        return args.fake_exit
    steps = max(1, min(args.max_steps, 5))
    first = 1
    if args.fake_checkpoints and args.resume == "auto":
        done = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-[0-9]*")]
        first = max(done, default=0) + 1
        record("resumed", from_step=first - 1)
        print(f"fake_train: resumed from checkpoint-{first - 1}", flush=True)
    hang_at = args.fake_hang_at
    if hang_at is not None and args.fake_hang_once:
        if (out / ".fake_hang_done").exists():
            hang_at = None
        else:
            (out / ".fake_hang_done").write_text("1")
    if hang_at == 0:
        hang()
    pace = args.fake_step_seconds if args.fake_step_seconds is not None else seconds / steps
    for step in range(first, steps + 1):
        time.sleep(pace)
        write_progress(step, steps, "running")
        if args.fake_checkpoints:
            (out / f"checkpoint-{step}").mkdir(exist_ok=True)
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text(
                json.dumps({"global_step": step})
            )
        print(f"fake_train: step {step}/{steps} loss=0.{step}", flush=True)
        if step == hang_at:
            hang()
    write_progress(steps, steps, "finished")
    record("end", exit_code=args.fake_exit)
    return args.fake_exit


if __name__ == "__main__":
    sys.exit(main())
