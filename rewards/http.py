"""A reward function that asks an HTTP reward server for its scores.

The server runs as the job's `reward` role; the scheduler injects its address as
`RLFLEET_REWARD_ADDR` and its named port `http` as `RLFLEET_REWARD_HTTP` (another role name:
set `REWARD_SERVER_ROLE`). Use it as `--reward_function rewards.http:remote_score`. The protocol
and an example server are in docs/reward-server.md and examples/reward_server.py.

Every request carries the attempt's token (`Authorization: Bearer $RLFLEET_GROUP_TOKEN`, when
set) and goes straight to the server: proxies in the environment are not used for it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from rewards._text import Completion, completion_text

ROLE_ENV = "REWARD_SERVER_ROLE"
TIMEOUT_ENV = "REWARD_SERVER_TIMEOUT"
RETRY_ENV = "REWARD_SERVER_RETRY"
"""Seconds a request is tried again while the server cannot be reached, answers 5xx or
does not answer in time: long enough for a role with `restart: on-failure` to come back."""
TOKEN_ENV = "RLFLEET_GROUP_TOKEN"
"""The job group's per-attempt token: sent with every request (never printed)."""
DEFAULT_ROLE = "reward"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_S = 120.0
"""The scheduler restarts a role that stopped answering after 30 s of failed checks, made
every 5 s, then waits its backoff (1 s, 2 s… at most 30 s) and its start: 120 s covers the
first restarts of a server that starts in a few seconds."""
RETRY_DELAY_S = (0.5, 5.0)
"""The first pause between tries, doubled after each, and the longest."""
SCORE_PATH = "/score"

# \Z, not $: `$` also matches before a final newline.
_ROLE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}\Z")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


class RewardServerError(ValueError):
    """The reward server is misconfigured or answered nonsense: retrying will not help."""


def server_url(env: Mapping[str, str] | None = None) -> str:
    """The score endpoint's URL, built only from a validated host and port in the environment."""
    env = os.environ if env is None else env
    role = env.get(ROLE_ENV) or DEFAULT_ROLE
    if not _ROLE.match(role):
        raise RewardServerError(f"{ROLE_ENV}={role!r} is not a role name")
    prefix = f"RLFLEET_{role.upper()}"
    host = _host(env.get(f"{prefix}_ADDR", ""), f"{prefix}_ADDR")
    port = _port(env.get(f"{prefix}_HTTP", ""), f"{prefix}_HTTP")
    return f"http://{host}:{port}{SCORE_PATH}"


def _host(value: str, name: str) -> str:
    if not value:
        raise RewardServerError(f"{name} is not set: no address for the reward server")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        labels = value.rstrip(".").split(".")
        if len(value) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
            raise RewardServerError(f"{name}={value!r} is not a host name or address") from None
        return value
    return f"[{address}]" if address.version == 6 else str(address)


def _port(value: str, name: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise RewardServerError(f"{name}={value!r} is not a port number")
    return int(value)


def _seconds(env: Mapping[str, str], name: str, default: float, *, zero_ok: bool) -> float:
    """`name` from the environment as a finite number of seconds (> 0, or >= 0 where
    `zero_ok`); `default` when unset or empty."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    above = value >= 0 if zero_ok else value > 0
    if not (above and value < float("inf")):
        raise RewardServerError(f"{name}={raw!r} is not a number of seconds")
    return value


def _headers(env: Mapping[str, str]) -> dict[str, str]:
    """The request's headers: JSON, and the job group's token when it has one."""
    headers = {"Content-Type": "application/json"}
    token = env.get(TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Requests to the group's own server go straight to it: a proxy in the environment
(`http_proxy`, for the VM's downloads) is never used for them."""


def remote_score(
    prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
) -> list[float | None]:
    """POST {prompts, completions} to the reward server and return its `scores`.

    A server that does not answer within `$REWARD_SERVER_TIMEOUT` seconds (default 30), refuses
    the connection or answers 5xx is asked again (the request is the same: scoring has no
    side effect), after 0.5 s, 1 s, 2 s… (at most 5 s), for `$REWARD_SERVER_RETRY` seconds
    (default 120; 0: never), the time a server role restarted in place needs to come back;
    then it raises TimeoutError or ConnectionError, which train_grpo.py turns into exit 75
    (retried). A bad answer raises RewardServerError at once (exit 64).
    """
    import time

    url = server_url()
    timeout = _seconds(os.environ, TIMEOUT_ENV, DEFAULT_TIMEOUT_S, zero_ok=False)
    give_up = time.monotonic() + _seconds(os.environ, RETRY_ENV, DEFAULT_RETRY_S, zero_ok=True)
    body = json.dumps(
        {"prompts": list(prompts), "completions": [completion_text(c) for c in completions]}
    ).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers=_headers(os.environ))
    pause, longest = RETRY_DELAY_S
    while True:
        try:
            return _post(request, url, timeout, len(completions))
        except (TimeoutError, ConnectionError):
            if time.monotonic() + pause > give_up:
                raise
        time.sleep(pause)
        pause = min(pause * 2, longest)


def _post(
    request: urllib.request.Request, url: str, timeout: float, expected: int
) -> list[float | None]:
    """One try of `remote_score`'s request."""
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            answer = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:
            raise ConnectionError(f"reward server at {url} answered {exc.code}") from exc
        raise RewardServerError(f"reward server at {url} answered {exc.code}") from exc
    except (TimeoutError, urllib.error.URLError) as exc:
        if isinstance(exc, TimeoutError) or isinstance(exc.reason, TimeoutError):
            raise TimeoutError(f"reward server at {url} did not answer in {timeout:g} s") from exc
        raise ConnectionError(f"reward server at {url} unreachable: {exc.reason}") from exc
    except ConnectionError as exc:  # reset or closed mid-answer: not a URLError
        raise ConnectionError(f"reward server at {url} unreachable: {exc}") from exc
    return _scores(answer, url, expected)


def _scores(answer: bytes, url: str, expected: int) -> list[float | None]:
    try:
        scores = json.loads(answer)["scores"]
    except (ValueError, KeyError, TypeError):
        raise RewardServerError(f"reward server at {url} sent no JSON object with scores") from None
    if not isinstance(scores, list) or len(scores) != expected:
        raise RewardServerError(f"reward server at {url} sent no list of {expected} scores")
    return scores
