"""How fast the command line answers: `rlfleet --help`, `job list` and `job submit`.

People script submissions in loops, so a command's start-up is part of its cost. Each
command runs as a fresh process, as a user runs it, `--runs` times (median reported), with
an embedded Postgres (migrated) and an embedded NATS for `list` and `submit`. The baseline
is the interpreter's own start (`python -c pass`); the ratios say how much the CLI adds.

    python bench/cli.py [--runs 5] [--module]

prints `cli: help_s=… list_s=… submit_s=… python_s=… help_ratio=… submit_ratio=…`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.embedded import EmbeddedNats, EmbeddedPostgres  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402


def rlfleet(module: bool) -> list[str]:
    """The `rlfleet` console script next to this interpreter, else (or with `module`)
    `python -m scheduler.cli`, which runs the code in the current directory."""
    script = Path(sys.executable).with_name("rlfleet")
    if script.exists() and not module:
        return [str(script)]
    return [sys.executable, "-m", "scheduler.cli"]


def timed(argv: Sequence[str], env: dict[str, str], runs: int) -> float:
    """Median wall time of `argv` over `runs` runs; each must succeed."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(
            argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    """Start the services, time the commands, print one line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="Runs per command (median).")
    parser.add_argument(
        "--module", action="store_true", help="Run `python -m scheduler.cli` from this checkout."
    )
    args = parser.parse_args()
    cli = rlfleet(args.module)
    submit = [
        *cli,
        "job",
        "submit",
        "--model",
        "m",
        "--dataset",
        "d",
        "--reward-function",
        "correctness",
    ]
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-cli-") as tmp:
        pg = EmbeddedPostgres(Path(tmp) / "pg").start()
        nats_server = EmbeddedNats(Path(tmp) / "nats").start()
        try:
            upgrade(pg.url())
            env = {
                **os.environ,
                "RLFLEET_DATABASE_URL": pg.url(),
                "RLFLEET_NATS_URL": nats_server.url,
            }
            subprocess.run(submit, env=env, check=True, capture_output=True)  # the stream
            python_s = timed([sys.executable, "-c", "pass"], env, args.runs)
            help_s = timed([*cli, "--help"], env, args.runs)
            list_s = timed([*cli, "job", "list"], env, args.runs)
            submit_s = timed(submit, env, args.runs)
        finally:
            nats_server.stop()
            pg.stop()
    print(
        f"cli: help_s={help_s:.3f} list_s={list_s:.3f} submit_s={submit_s:.3f} "
        f"python_s={python_s:.3f} help_ratio={help_s / python_s:.1f} "
        f"submit_ratio={submit_s / python_s:.1f} load={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
