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
TOKEN_ENV = "RLFLEET_GROUP_TOKEN"
"""The job group's per-attempt token: sent with every request (never printed)."""
DEFAULT_ROLE = "reward"
DEFAULT_TIMEOUT_S = 30.0
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


def _timeout(env: Mapping[str, str]) -> float:
    raw = env.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        timeout = float(raw)
    except ValueError:
        timeout = 0.0
    if not timeout > 0:
        raise RewardServerError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds")
    return timeout


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
    the connection or answers 5xx raises TimeoutError or ConnectionError, which train_grpo.py
    turns into exit 75 (retried); a bad answer raises RewardServerError (exit 64).
    """
    url = server_url()
    timeout = _timeout(os.environ)
    body = json.dumps(
        {"prompts": list(prompts), "completions": [completion_text(c) for c in completions]}
    ).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers=_headers(os.environ))
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
    return _scores(answer, url, len(completions))


def _scores(answer: bytes, url: str, expected: int) -> list[float | None]:
    try:
        scores = json.loads(answer)["scores"]
    except (ValueError, KeyError, TypeError):
        raise RewardServerError(f"reward server at {url} sent no JSON object with scores") from None
    if not isinstance(scores, list) or len(scores) != expected:
        raise RewardServerError(f"reward server at {url} sent no list of {expected} scores")
    return scores
