"""A small HTTP reward server: the `reward` role of a job group, for `rewards.http:remote_score`.

    python examples/reward_server.py --port 8321 --keyword hello

POST /score with {"prompts": [...], "completions": ["text", ...]} answers {"scores": [...]}:
each completion scores the share of its characters that are letters of the keyword (so a
model learns to write them), 1.0 when the keyword appears as a word. GET /health answers
{"status": "ok", "requests": N, "scores": [...]}: how many score requests it served and every
score it sent, oldest first. Standard library only; replace `score` with your own model.

As a role of a job group it listens at its role's address (`RLFLEET_<ROLE>_ADDR`: loopback
when the whole group runs on one VM) and answers only requests that carry the attempt's
token (`Authorization: Bearer $RLFLEET_GROUP_TOKEN`, compared in constant time), as
`rewards.http` and the group's readiness check send it. Run by hand, it listens on
127.0.0.1 and, without RLFLEET_GROUP_TOKEN, asks for no token.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 16 * 1024 * 1024  # Refuse larger requests rather than read them into memory.
TOKEN_ENV = "RLFLEET_GROUP_TOKEN"
"""The job group's per-attempt token, which every request must carry (when it is set)."""


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (always, when there is none)."""
    if not token:
        return True
    given = (header or "").encode()
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def score(completion: str, keyword: str) -> float:
    """1.0 if `keyword` is a word of `completion`, else the share of its keyword letters."""
    if re.search(rf"(?<!\w){re.escape(keyword)}(?!\w)", completion, re.IGNORECASE):
        return 1.0
    if not completion:
        return 0.0
    letters = set(keyword.lower())
    return round(sum(ch.lower() in letters for ch in completion) / len(completion), 6)


class Ledger:
    """What the server has answered so far (read by /health)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.scores: list[float] = []

    def record(self, scores: list[float]) -> None:
        """Count one answered request and keep its scores."""
        with self.lock:
            self.requests += 1
            self.scores.extend(scores)

    def snapshot(self) -> dict[str, Any]:
        """The health answer: status, requests served, scores sent."""
        with self.lock:
            return {"status": "ok", "requests": self.requests, "scores": list(self.scores)}


def make_handler(keyword: str, ledger: Ledger, token: str = "") -> type[BaseHTTPRequestHandler]:
    """A request handler class scoring with `keyword` and recording into `ledger`, for
    requests that carry `token` (none needed when it is empty)."""

    class Handler(BaseHTTPRequestHandler):
        def _refused(self) -> bool:
            if authorized(self.headers.get("Authorization"), token):
                return False
            self._send(401, {"error": "a valid token is required"})
            return True

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self._refused():
                return
            if self.path.rstrip("/") == "/health":
                self._send(200, ledger.snapshot())
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self._refused():
                return
            if self.path != "/score":
                self._send(404, {"error": "not found"})
                return
            try:
                completions = self._completions()
            except ValueError as exc:
                self._send(400, {"error": str(exc)})
                return
            scores = [score(text, keyword) for text in completions]
            ledger.record(scores)
            self._send(200, {"scores": scores})

        def _completions(self) -> list[str]:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                raise ValueError("a JSON body of at most 16 MiB is required")
            body = json.loads(self.rfile.read(length))
            completions = body.get("completions") if isinstance(body, dict) else None
            texts = completions if isinstance(completions, list) else [None]
            if not all(isinstance(text, str) for text in texts):
                raise ValueError("'completions' must be a list of strings")
            return [str(text) for text in texts]

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
            pass  # One line per request would drown the job's log.

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted (SIGTERM or Ctrl-C)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    role = (os.environ.get("RLFLEET_ROLE") or "reward").upper()
    parser.add_argument(
        "--host",
        default=os.environ.get(f"RLFLEET_{role}_ADDR") or "127.0.0.1",
        help="address to listen on (default: $RLFLEET_<ROLE>_ADDR, the address the scheduler "
        "gave this role, else 127.0.0.1)",
    )
    injected = os.environ.get(f"RLFLEET_{role}_HTTP") or os.environ.get("RLFLEET_REWARD_HTTP", "")
    parser.add_argument(
        "--port",
        type=int,
        default=int(injected) if injected.isdigit() else None,
        required=not injected.isdigit(),
        help="port to listen on (default: $RLFLEET_<ROLE>_HTTP, the port the scheduler picked)",
    )
    parser.add_argument("--keyword", default="hello", help="the word completions are scored on")
    args = parser.parse_args(argv)
    ledger = Ledger()
    token = os.environ.get(TOKEN_ENV, "")
    handler = make_handler(args.keyword, ledger, token)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    print(f"reward server listening on {args.host}:{args.port}", flush=True)
    # A job group stops its services with SIGTERM: end the way Ctrl-C does, with a summary.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        print(f"reward server stopped after {ledger.requests} score requests", flush=True)
    return 0


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
