"""Generate training/data/arithmetic.jsonl: small GSM8K-format arithmetic problems.

python -m training.make_dataset [--rows 200] [--seed 0] [--output training/data/arithmetic.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).parent / "data" / "arithmetic.jsonl"
_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_row(rng: random.Random) -> dict[str, str]:
    """One problem: `question`, and `answer` ending in `#### N` like GSM8K."""
    op = rng.choice(sorted(_OPERATIONS))
    a, b = rng.randint(1, 99), rng.randint(1, 12 if op == "*" else 99)
    result = _OPERATIONS[op](a, b)
    return {
        "question": f"What is {a} {op} {b}?",
        "answer": f"{a} {op} {b} = {result}\n#### {result}",
    }


def make_rows(count: int, seed: int) -> list[dict[str, str]]:
    """`count` problems, the same ones for the same seed."""
    rng = random.Random(seed)
    return [make_row(rng) for _ in range(count)]


def main(argv: list[str] | None = None) -> None:
    """Write the dataset as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200, help="number of problems (default: 200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSONL file to write")
    args = parser.parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as handle:
        for row in make_rows(args.rows, args.seed):
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {args.rows} rows to {args.output}")


if __name__ == "__main__":
    main()
