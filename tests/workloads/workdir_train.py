"""A stand-in training entrypoint for the workdir tests (no torch): it resolves
`--reward_function module:function` and `--dataset PATH` as train_grpo.py does (the module
from sys.path and the working directory, the path from the working directory), scores
every row's `completion`, writes `scratch.txt` into its working directory, and records
what it saw in `<--output_dir>/result-<attempt>-<node rank>.json`, with whether the
reward's module was importable before the working directory was put on sys.path.
Standard library only (a multi-node test's stand-in python runs it with `-S`).
`--fail_first` exits 1 on attempt 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(prog="workdir_train")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--reward_function", action="append", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--fail_first", action="store_true")
    args, _unknown = parser.parse_known_args()
    import importlib
    import importlib.util

    # Before the working directory is put on sys.path (as train_grpo.py's loader does):
    # importable through PYTHONPATH alone.
    module, _, name = args.reward_function[0].partition(":")
    on_path = importlib.util.find_spec(module) is not None
    sys.path.insert(0, os.getcwd())
    reward = getattr(importlib.import_module(module), name)
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line]
    scores = reward([r["prompt"] for r in rows], [r["completion"] for r in rows])
    Path("scratch.txt").write_text("written by the attempt\n")
    attempt = int(os.environ.get("RLFLEET_ATTEMPT", "0"))
    out = Path(os.path.expanduser(args.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RLFLEET_NODE_RANK", "0"))
    (out / f"result-{attempt}-{rank}.json").write_text(
        json.dumps(
            {
                "scores": scores,
                "on_path": on_path,
                "cwd": os.getcwd(),
                "pythonpath": os.environ.get("PYTHONPATH", ""),
                "workdir": os.environ.get("RLFLEET_WORKDIR", ""),
            }
        )
    )
    return 1 if args.fail_first and attempt == 1 else 0


if __name__ == "__main__":
    sys.exit(main())
