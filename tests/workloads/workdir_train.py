"""A stand-in training entrypoint for the workdir tests (no torch): it resolves
`--reward_function module:function` and `--dataset PATH` as train_grpo.py does (the module
from sys.path, the path from the working directory), scores every row's `completion`,
writes `scratch.txt` into its working directory, and records whether the reward's
module was importable before the loader put the working directory on sys.path and what it saw in
`<--output_dir>/result-<attempt>.json`. `--fail_first` exits 1 on attempt 1."""

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
    import importlib.util

    from rewards.loader import load_reward

    # Before the loader adds the working directory: importable through PYTHONPATH alone.
    module = args.reward_function[0].partition(":")[0]
    on_path = importlib.util.find_spec(module) is not None
    reward = load_reward(args.reward_function[0], {})
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line]
    scores = reward([r["prompt"] for r in rows], [r["completion"] for r in rows])
    Path("scratch.txt").write_text("written by the attempt\n")
    attempt = int(os.environ.get("RLFLEET_ATTEMPT", "0"))
    out = Path(os.path.expanduser(args.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result-{attempt}.json").write_text(
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
