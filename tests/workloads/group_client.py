"""A stand-in trainer role of a job group (no torch): asks the `reward` role's server for its
health and one score at the address and port the scheduler injected, prints what it got as
one JSON line, then sleeps `argv[1]` seconds on the first attempt (`argv[2]` on later ones)
and exits 0. A server that is not up yet fails it at once (exit 1), so a passing run proves
the supervisor started it only after the server's readiness check passed."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request


def main(argv: list[str]) -> int:
    """Call the reward server once, report, sleep, exit 0."""
    addr, port = os.environ["RLFLEET_REWARD_ADDR"], os.environ["RLFLEET_REWARD_HTTP"]
    base = f"http://{addr}:{port}"
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as answer:
            health = json.loads(answer.read())
        body = json.dumps({"prompts": ["p"], "completions": ["hello there"]}).encode()
        request = urllib.request.Request(
            base + "/score", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            scores = json.loads(answer.read())["scores"]
    except OSError as exc:
        print(f"group_client: the reward server did not answer: {exc}", flush=True)
        return 1
    attempt = os.environ.get("RLFLEET_ATTEMPT", "1")
    report = {
        "health": health.get("status"),
        "scores": scores,
        "addr": addr,
        "port": int(port),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "role": os.environ.get("RLFLEET_ROLE"),
        "attempt": int(attempt),
        "pid": os.getpid(),
    }
    print("group_client: " + json.dumps(report), flush=True)
    time.sleep(float(argv[1] if attempt == "1" else argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
