"""A stand-in for `trl vllm-serve` in scheduler tests: it is NOT vLLM and generates nothing.

It takes the flags the scheduler's `vllm` role passes (`--model`, `--host`, `--port`,
`--tensor_parallel_size`), prints them with its CUDA_VISIBLE_DEVICES as one JSON line, and
answers GET /health with 200 on that host and port until it is stopped: enough to prove the
command line, the environment and the readiness wait of vLLM server mode on a machine
without GPUs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class Health(BaseHTTPRequestHandler):
    """GET /health → 200; anything else 404."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path.rstrip("/") == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass


def main(argv: list[str]) -> int:
    """Print what it was given, then answer /health until stopped."""
    parser = argparse.ArgumentParser(prog="fake_vllm")
    parser.add_argument("command", choices=["vllm-serve"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tensor_parallel_size", type=int, required=True)
    args = parser.parse_args(argv)
    seen = {
        "argv": argv,
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "role": os.environ.get("RLFLEET_ROLE"),
        "nccl": os.environ.get("RLFLEET_VLLM_NCCL"),
    }
    print("fake_vllm: " + json.dumps(seen), flush=True)
    HTTPServer((args.host, args.port), Health).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
