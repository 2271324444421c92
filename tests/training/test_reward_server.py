"""The reward-server example end to end: examples/reward_server.py scores over HTTP what
train_grpo.py generates, through `rewards.http:remote_score` at the address the scheduler
injects; a server that stops answering ends training with exit 75 once it has been asked
again for REWARD_SERVER_RETRY seconds; one that comes back within them is asked again."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rewards.http import RewardServerError, server_url
from tests import ports
from tests.training.helpers import REPO, tiny_run_args, train_grpo

REWARD = "rewards.http:remote_score"


def _free_port() -> int:
    return ports.free_port()


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def reward_server() -> Iterator[int]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "reward_server.py"), "--host", "127.0.0.1",
         "--port", str(port), "--keyword", "hello"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _health(port)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.1)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _env(port: int, **extra: str) -> dict[str, str]:
    return {"RLFLEET_REWARD_ADDR": "127.0.0.1", "RLFLEET_REWARD_HTTP": str(port), **extra}


def test_the_url_comes_from_the_role_s_injected_address_and_port():
    env = {"RLFLEET_REWARD_ADDR": "10.0.0.7", "RLFLEET_REWARD_HTTP": "8321"}
    assert server_url(env) == "http://10.0.0.7:8321/score"
    judge = {
        "REWARD_SERVER_ROLE": "judge",
        "RLFLEET_JUDGE_ADDR": "fd00::1",
        "RLFLEET_JUDGE_HTTP": "80",
    }
    assert server_url(judge) == "http://[fd00::1]:80/score"
    assert server_url({**env, "RLFLEET_REWARD_ADDR": "reward-0.internal"}).startswith(
        "http://reward-0.internal:8321/"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RLFLEET_REWARD_HTTP": "8321"}, "RLFLEET_REWARD_ADDR is not set"),
        ({"RLFLEET_REWARD_ADDR": "evil.host/x?token=1", "RLFLEET_REWARD_HTTP": "1"}, "not a host"),
        ({"RLFLEET_REWARD_ADDR": "user@host", "RLFLEET_REWARD_HTTP": "1"}, "not a host"),
        ({"RLFLEET_REWARD_ADDR": "h", "RLFLEET_REWARD_HTTP": "99999"}, "not a port"),
        ({"RLFLEET_REWARD_ADDR": "h", "RLFLEET_REWARD_HTTP": "80/x"}, "not a port"),
        ({"REWARD_SERVER_ROLE": "a-b;rm", "RLFLEET_REWARD_ADDR": "h"}, "not a role name"),
        ({"REWARD_SERVER_ROLE": "judge\n", "RLFLEET_REWARD_ADDR": "h"}, "not a role name"),
        ({"RLFLEET_REWARD_ADDR": "h\n", "RLFLEET_REWARD_HTTP": "1"}, "not a host"),
    ],
)
def test_an_unusable_address_is_refused_before_any_request(env: dict[str, str], message: str):
    with pytest.raises(RewardServerError, match=message):
        server_url(env)


@pytest.mark.slow
def test_training_learns_from_scores_the_server_sent(
    reward_server: int, tiny_model: Path, tmp_path: Path
):
    out = tmp_path / "out"
    args = tiny_run_args(tiny_model, out, "--max_steps", "3", "--save_steps", "3")
    args[args.index("keyword_match")] = REWARD
    result = train_grpo(*args, cwd=tmp_path, env=_env(reward_server))
    assert result.returncode == 0, result.stderr[-3000:]

    served = _health(reward_server)
    # One request per step, 4 completions each (--num_generations 4, one process).
    assert served["requests"] == 3 and len(served["scores"]) == 12, served
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    logged = [e["rewards/remote_score/mean"] for e in state["log_history"] if "reward" in e]
    per_step = [sum(served["scores"][i : i + 4]) / 4 for i in range(0, 12, 4)]
    assert logged == pytest.approx(per_step, abs=1e-5)
    assert any(score > 0 for score in served["scores"]), "nothing for the model to learn from"


@pytest.mark.slow
def test_a_server_that_stops_answering_ends_training_with_exit_75(tiny_model: Path, tmp_path: Path):
    # Listening but never answering: the connection is accepted by the kernel, no reply comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        args = tiny_run_args(tiny_model, tmp_path / "out", "--max_steps", "3")
        args[args.index("keyword_match")] = REWARD
        # Asked again for 2 s (REWARD_SERVER_RETRY), then given up on.
        env = _env(port, REWARD_SERVER_TIMEOUT="1", REWARD_SERVER_RETRY="2")
        result = train_grpo(*args, cwd=tmp_path, env=env)
    assert result.returncode == 75, result.stderr[-3000:]
    assert result.stderr.rstrip("\n").splitlines()[-1] == (
        f"train-grpo: error: reward function {REWARD} raised TimeoutError: reward server at "
        f"http://127.0.0.1:{port}/score did not answer in 1 s"
    )
    assert "Traceback" not in result.stderr


def _start_server(port: int, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """examples/reward_server.py with `env` added to ours; returns once it answers."""
    import os

    server = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "reward_server.py"), "--port", str(port), *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise
            time.sleep(0.1)


def _status(port: int, path: str, headers: dict[str, str]) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with opener.open(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_server_answers_only_requests_with_the_groups_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given the per-attempt token a job group hands its roles (RLFLEET_GROUP_TOKEN), the
    example server answers /health and /score only to a request that carries it, and
    `remote_score` sends it; a proxy in the environment (http_proxy, pointing nowhere) is
    not used for the group's own server."""
    from rewards.http import remote_score

    token, port, dead = "f3" * 16, _free_port(), _free_port()
    server = _start_server(port, {"RLFLEET_GROUP_TOKEN": token})
    try:
        assert _status(port, "/health", {}) == 401
        assert _status(port, "/health", {"Authorization": "Bearer " + "0" * 32}) == 401
        assert _status(port, "/health", {"Authorization": f"Bearer {token}x"}) == 401
        assert _status(port, "/health", {"Authorization": f"Bearer {token}"}) == 200
        for name, value in _env(port, RLFLEET_GROUP_TOKEN=token).items():
            monkeypatch.setenv(name, value)
        for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy"):
            monkeypatch.setenv(proxy, f"http://127.0.0.1:{dead}")
        assert remote_score(["p"], ["hello there"]) == [1.0]
        monkeypatch.delenv("RLFLEET_GROUP_TOKEN")
        with pytest.raises(RewardServerError, match="answered 401"):
            remote_score(["p"], ["hello there"])
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    assert token not in out  # never printed


def test_the_server_listens_on_its_roles_address_else_loopback() -> None:
    """Without --host the example server listens where the scheduler said its role is
    (RLFLEET_<ROLE>_ADDR of RLFLEET_ROLE: loopback in a group on one VM), and run by hand
    on loopback, never on every interface."""
    port = _free_port()
    for env, expected in (
        ({"RLFLEET_ROLE": "judge", "RLFLEET_JUDGE_ADDR": "127.0.0.2"}, "127.0.0.2"),
        ({}, "127.0.0.1"),
    ):
        clean = {"RLFLEET_ROLE": "", "RLFLEET_REWARD_ADDR": "", **env}
        server = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "reward_server.py"), "--port", str(port)],
            env={**_base_env(), **clean},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            assert (
                server.stdout.readline().strip() == f"reward server listening on {expected}:{port}"
            )
        finally:
            server.terminate()
            server.communicate(timeout=30)


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}


def _serve_later(port: int, delay: float, code: int = 200) -> threading.Thread:
    """A thread that, after `delay` seconds, serves /score once at `port` (scores 1.0 per
    completion; `code` other than 200: that status, no scores)."""
    import http.server

    class Score(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"scores": [1.0] * len(asked["completions"])}).encode()
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body if code == 200 else b"{}")

        def log_message(self, *args: object) -> None:
            pass

    def serve() -> None:
        time.sleep(delay)
        with http.server.HTTPServer(("127.0.0.1", port), Score) as server:
            server.timeout = 30
            server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_server_coming_back_after_a_restart_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reward server restarted in place refuses connections for a moment at its address
    and port: the score request is made again until it answers (within
    REWARD_SERVER_RETRY), and no score is lost."""
    from rewards.http import remote_score

    port = _free_port()
    for name, value in _env(port, REWARD_SERVER_RETRY="30").items():
        monkeypatch.setenv(name, value)
    thread = _serve_later(port, 1.0)
    began = time.monotonic()
    assert remote_score(["p", "q"], ["a", "b"]) == [1.0, 1.0]
    assert time.monotonic() - began >= 1.0
    thread.join(timeout=30)


def test_asking_again_ends_after_reward_server_retry_and_never_for_a_bad_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rewards.http import remote_score

    port = _free_port()
    for name, value in _env(port, REWARD_SERVER_RETRY="0").items():
        monkeypatch.setenv(name, value)
    began = time.monotonic()
    with pytest.raises(ConnectionError, match="unreachable"):
        remote_score(["p"], ["a"])
    assert time.monotonic() - began < 5
    # A 4xx is a disagreement between trainer and server: never asked again.
    monkeypatch.setenv("REWARD_SERVER_RETRY", "30")
    thread = _serve_later(port, 0.0, code=400)
    time.sleep(0.5)
    with pytest.raises(RewardServerError, match="answered 400"):
        remote_score(["p"], ["a"])
    thread.join(timeout=30)
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv("REWARD_SERVER_RETRY", bad)
        with pytest.raises(RewardServerError, match="REWARD_SERVER_RETRY"):
            remote_score(["p"], ["a"])
    monkeypatch.setenv("REWARD_SERVER_RETRY", "0")
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("REWARD_SERVER_TIMEOUT", bad)
        with pytest.raises(RewardServerError, match="REWARD_SERVER_TIMEOUT"):
            remote_score(["p"], ["a"])
