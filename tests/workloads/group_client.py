"""A stand-in trainer role of a job group (no torch): asks the `reward` role's server for its
health (a plain urllib request with the attempt's token, which honours the proxy variables as
any client library does: the supervisor's `no_proxy` must let it through) and one score
(`rewards.http.remote_score`, the trainer's own client) at the address and port the scheduler
injected, and what the server answers a request without the token; prints what it got as
one JSON line, then sleeps `argv[1]` seconds on the first attempt (`argv[2]` on later ones)
and exits 0. A server that is not up yet fails it at once (exit 1), so a passing run proves
the supervisor started it only after the server's readiness check passed. With
GROUP_CLIENT_UNTIL (a path) it instead waits for that file (at most `argv[1]` seconds), asks
for a score again, prints `group_client: again {"scores": …}` and exits 0.

As a rank of a role on several nodes (RLFLEET_NUM_NODES set) it first meets the other
ranks where the scheduler said the rendezvous is: rank 0 listens on MASTER_ADDR:MASTER_PORT
and waits for every other rank to connect and say its rank; the others connect (retrying
for 60 s) and wait for rank 0's answer. The report then says which ranks met."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # rewards, as on a VM checkout

from rewards.http import RewardServerError, remote_score  # noqa: E402

MEET_S = 60.0


def main(argv: list[str]) -> int:
    """Call the reward server once, meet the other ranks, report, sleep, exit 0."""
    addr, port = os.environ["RLFLEET_REWARD_ADDR"], os.environ["RLFLEET_REWARD_HTTP"]
    base = f"http://{addr}:{port}"
    token = os.environ.get("RLFLEET_GROUP_TOKEN", "")
    try:
        request = urllib.request.Request(
            base + "/health", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            health = json.loads(answer.read())
        scores = remote_score(["p"], ["hello there"])
        without_token = _status(base + "/health")
    except (OSError, RewardServerError) as exc:
        print(f"group_client: the reward server did not answer: {exc}", flush=True)
        return 1
    attempt = os.environ.get("RLFLEET_ATTEMPT", "1")
    report: dict[str, Any] = {
        "health": health.get("status"),
        "scores": scores,
        "without_token": without_token,
        "has_token": len(token) == 32,
        "addr": addr,
        "port": int(port),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "role": os.environ.get("RLFLEET_ROLE"),
        "attempt": int(attempt),
        "pid": os.getpid(),
    }
    if "RLFLEET_NUM_NODES" in os.environ:
        try:
            report.update(meet())
        except OSError as exc:
            print(f"group_client: the ranks did not meet: {exc}", flush=True)
            return 1
    print("group_client: " + json.dumps(report), flush=True)
    until = os.environ.get("GROUP_CLIENT_UNTIL")
    if until:
        return score_again(Path(until), float(argv[1]))
    time.sleep(float(argv[1] if attempt == "1" else argv[2]))
    return 0


def score_again(until: Path, most_s: float) -> int:
    """Wait (at most `most_s` seconds) for the file `until`, then ask for a score again:
    print it and exit 0, else exit 1."""
    deadline = time.monotonic() + most_s
    while not until.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        scores = remote_score(["p"], ["hello again"])
    except (OSError, RewardServerError) as exc:
        print(f"group_client: the reward server did not answer again: {exc}", flush=True)
        return 1
    print("group_client: again " + json.dumps({"scores": scores}), flush=True)
    return 0


def _status(url: str) -> int:
    """The HTTP status the server answers a GET without the token."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def meet() -> dict[str, Any]:
    """Meet every other rank at MASTER_ADDR:MASTER_PORT; what this rank saw of them."""
    env = os.environ
    rank, nodes = int(env["RLFLEET_NODE_RANK"]), int(env["RLFLEET_NUM_NODES"])
    master = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    seen: dict[str, Any] = {
        "rank": rank,
        "nodes": nodes,
        "master": list(master),
        "node_addrs": env["RLFLEET_NODE_ADDRS"].split(","),
        "world_size": int(env["WORLD_SIZE"]),
    }
    if rank == 0:
        peers = []
        with socket.create_server(master) as server:
            server.settimeout(MEET_S)
            while len(peers) < nodes - 1:
                conn, _ = server.accept()
                with conn:
                    peers.append(int(conn.recv(64).decode()))
                    conn.sendall(b"welcome")
        seen["peers"] = sorted(peers)
        return seen
    deadline = time.monotonic() + MEET_S
    while True:
        try:
            with socket.create_connection(master, timeout=5) as conn:
                conn.sendall(str(rank).encode())
                seen["answer"] = conn.recv(64).decode()
                return seen
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
