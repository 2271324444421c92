"""Job groups without services: what each role runs (argv, GPUs, variables, readiness), the
vLLM server mode's exact command lines, and the supervisor's lifecycle with real processes
on this machine (no SSH: the supervisor is a plain program)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.errors import BadInput
from scheduler.groups import GroupPlace, group_launch, node_port_needs
from scheduler.jobspec import parse_data, parse_text
from scheduler.supervisor import NOT_READY_EXIT, expand
from scheduler.verdicts import group_failure_line
from tests import ports

PLACE = GroupPlace(
    python="/opt/venv/bin/python",
    entrypoint="training/train_grpo.py",
    address="10.0.0.5",
    gpus=["GPU-a", "GPU-b", "GPU-c"],
    output_dir="~/.rlfleet/x/outputs/7",
    attempt=1,
)
REWARD_GROUP = b"""
roles:
  reward:
    command: python examples/reward_server.py
    ports: [http]
    ready: {http: /health, timeout: 30}
  trainer:
    gpus: 3
    depends_on: [reward]
    train:
      model: tiny
      dataset: data.jsonl
      reward_functions: rewards.http:remote_score
      args: [--max_steps, "5"]
"""


def test_each_role_gets_its_gpus_ports_addresses_and_command() -> None:
    group = parse_text(REWARD_GROUP)
    assert node_port_needs(group) == [[("reward", "http")]]
    config = group_launch(group, PLACE, {("reward", "http"): 41000}).config
    reward, trainer = config["roles"]
    assert [reward["name"], trainer["name"]] == ["reward", "trainer"]
    assert reward["argv"] == ["python", "examples/reward_server.py"]
    assert reward["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert trainer["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b,GPU-c"
    assert trainer["argv"] == [
        "/opt/venv/bin/python", "-m", "accelerate.commands.launch", "--num_processes", "3",
        "training/train_grpo.py", "--model", "tiny", "--dataset", "data.jsonl",
        "--reward_function", "rewards.http:remote_score",
        "--output_dir", ".rlfleet/x/outputs/7", "--max_steps", "5",
    ]  # fmt: skip
    assert trainer["depends_on"] == ["reward"] and trainer["primary"] and not reward["primary"]
    # Every role on one VM: each is reached on loopback, never on the VM's network.
    assert config["env"] == {
        "RLFLEET_REWARD_ADDR": "127.0.0.1",
        "RLFLEET_REWARD_HTTP": "41000",
        "RLFLEET_TRAINER_ADDR": "127.0.0.1",
    }
    assert config["checks"] == {
        "reward": {"host": "127.0.0.1", "port": 41000, "path": "/health", "timeout_s": 30}
    }
    again = group_launch(group, _at(2), {("reward", "http"): 41000})
    assert again.config["roles"][1]["argv"][-2:] == ["--resume", "auto"]


def _at(attempt: int) -> GroupPlace:
    return GroupPlace(**{**PLACE.__dict__, "attempt": attempt})


def test_vllm_server_mode_command_lines_and_environment() -> None:
    """`vllm_server_gpus: 2` beside a one-GPU trainer: `trl vllm-serve` with the trainer's
    model on the first two GPUs, tensor parallel over them, at the VM's address and its
    own port, on loopback (the trainer is its only client, beside it); the trainer on the
    third GPU in server mode with the injected address and ports, started only once GET
    /health answers."""
    group = parse_text(
        b"vllm_server_gpus: 2\n"
        b"roles:\n  trainer:\n    gpus: 1\n    train: {model: Qwen/Qwen2.5-0.5B, dataset: d, "
        b"reward_functions: [format], args: [--max_steps, '3']}\n"
    )
    ports = {("vllm", "http"): 40001, ("vllm", "nccl"): 40002}
    assert [sorted(needs) for needs in node_port_needs(group)] == [sorted(ports)]
    config = group_launch(group, PLACE, ports).config
    vllm, trainer = config["roles"]
    env = {**config["env"]}
    assert vllm["name"] == "vllm" and not vllm["primary"]
    assert [expand(w, env) for w in vllm["argv"]] == [
        "/opt/venv/bin/python", "-m", "trl.cli.main", "vllm-serve",
        "--model", "Qwen/Qwen2.5-0.5B", "--host", "127.0.0.1", "--port", "40001",
        "--tensor_parallel_size", "2",
    ]  # fmt: skip
    assert vllm["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert trainer["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-c"
    assert trainer["depends_on"] == ["vllm"]
    assert [expand(w, env) for w in trainer["argv"]] == [
        "/opt/venv/bin/python", "training/train_grpo.py",
        "--model", "Qwen/Qwen2.5-0.5B", "--dataset", "d", "--reward_function", "format",
        "--output_dir", ".rlfleet/x/outputs/7", "--max_steps", "3",
        "--use_vllm", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
        "--vllm_server_port", "40001", "--vllm_group_port", "40002",
    ]  # fmt: skip
    assert config["checks"]["vllm"] == {
        "host": "127.0.0.1", "port": 40001, "path": "/health", "timeout_s": 900
    }  # fmt: skip
    assert env == {
        "RLFLEET_VLLM_ADDR": "127.0.0.1",
        "RLFLEET_VLLM_HTTP": "40001",
        "RLFLEET_VLLM_NCCL": "40002",
        "RLFLEET_TRAINER_ADDR": "127.0.0.1",
    }


def test_the_vllm_flag_gives_the_same_group_as_the_file() -> None:
    """`job submit … --vllm-server-gpus 2` stores the roles the YAML key gives."""
    from scheduler.cli.jobfile import with_vllm_server
    from scheduler.jobs import JobSpec

    spec = with_vllm_server(
        JobSpec(model="m", dataset="d", reward_functions=("format",), extra_args=("--seed", "1")),
        2,
    )
    assert spec.gpus == 3 and spec.roles is not None
    from_file = parse_data(
        {
            "vllm_server_gpus": 2,
            "roles": {
                "trainer": {
                    "train": {"model": "m", "dataset": "d", "reward_functions": ["format"]},
                }
            },
        }
    )
    assert parse_data(spec.roles).role("vllm") == from_file.role("vllm")
    assert parse_data(spec.roles).role("trainer").train.args[:2] == ("--seed", "1")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"vllm_server_gpus": 1, "roles": {"a": {"command": ["x"], "gpus": 1}}},
            "vllm_server_gpus: needs exactly one role with train:",
        ),
        (
            {
                "vllm_server_gpus": 1,
                "roles": {
                    "t": {
                        "train": {
                            "model": "m",
                            "dataset": "d",
                            "reward_functions": ["f"],
                            "args": ["--vllm_mode=colocate"],
                        }
                    }
                },
            },
            "roles.t.train.args[0]: --vllm_mode is set by the vLLM server mode",
        ),
    ],
)
def test_the_vllm_server_mode_refuses_what_it_cannot_do(data: object, message: str) -> None:
    with pytest.raises(BadInput, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_data(data)


def test_stored_roles_read_back_as_the_same_group_without_env_values() -> None:
    group = parse_text(
        REWARD_GROUP.replace(b"    gpus: 3\n", b"    gpus: 3\n    env: {K: s3cret-value}\n")
    )
    stored = json.loads(json.dumps(group.to_data()))
    assert "s3cret-value" not in json.dumps(stored)
    back = parse_data(stored)
    assert back.start_order() == group.start_order()
    assert [r.ports for r in back.roles] == [r.ports for r in group.roles]
    assert group.env() == (("K", "s3cret-value"),) and back.env() == ()


# -- the supervisor, with real processes ---------------------------------------------------

SERVER = (
    "import http.server, os, sys, time\n"
    "time.sleep(float(sys.argv[1]))\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        token = os.environ.get('RLFLEET_GROUP_TOKEN')\n"
    "        if token and self.headers.get('Authorization') != 'Bearer ' + token:\n"
    "            self.send_response(401); self.end_headers(); return\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
    "    def log_message(self, *a): pass\n"
    "open(os.path.join(sys.argv[2], 'server.pid'), 'w').write(str(os.getpid()))\n"
    "print('listening', flush=True)\n"
    "http.server.HTTPServer(('127.0.0.1', int(os.environ['RLFLEET_SRV_HTTP'])),"
    " H).serve_forever()\n"
)
CLIENT = (
    "import os, sys, time, urllib.request\n"
    "url = 'http://%s:%s/' % (os.environ['RLFLEET_SRV_ADDR'], os.environ['RLFLEET_SRV_HTTP'])\n"
    "token = os.environ.get('RLFLEET_GROUP_TOKEN')\n"
    "headers = {'Authorization': 'Bearer ' + token} if token else {}\n"
    "try:\n"
    "    urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5).read()\n"
    "    print('first try ok', flush=True)\n"
    "except OSError as exc:\n"
    "    print('first try failed', exc, flush=True)\n"
    "print('no_proxy=%s NO_PROXY=%s' % (os.environ.get('no_proxy'), os.environ.get('NO_PROXY')))\n"
    "open(os.path.join(sys.argv[2], 'client.pid'), 'w').write(str(os.getpid()))\n"
    "time.sleep(float(sys.argv[1]))\n"
)


def free_port() -> int:
    return ports.free_port()


def write_group(
    folder: Path, *, server_delay: float, client_s: float, timeout: int = 20
) -> tuple[Path, int]:
    """A group.json of a server (`srv`, ready on HTTP) and a primary client depending on it."""
    (folder / "server.py").write_text(SERVER)
    (folder / "client.py").write_text(CLIENT)
    port = free_port()
    config = {
        "roles": [
            {
                "name": "srv",
                "argv": [sys.executable, str(folder / "server.py"), str(server_delay), str(folder)],
                "env": {},
                "primary": False,
                "depends_on": [],
            },
            {
                "name": "client",
                "argv": [sys.executable, str(folder / "client.py"), str(client_s), str(folder)],
                "env": {},
                "primary": True,
                "depends_on": ["srv"],
            },
        ],
        "checks": {
            "srv": {"host": "127.0.0.1", "port": port, "path": "/health", "timeout_s": timeout}
        },
        "env": {"RLFLEET_SRV_ADDR": "127.0.0.1", "RLFLEET_SRV_HTTP": str(port)},
        "grace_s": 2,
        "stop_grace_s": 2,
    }
    path = folder / "group.json"
    path.write_text(json.dumps(config))
    return path, port


def supervise(path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    source = Path(__file__).resolve().parents[2] / "scheduler" / "supervisor.py"
    return subprocess.Popen(
        [sys.executable, str(source), str(path)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def wait_for(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def test_the_client_starts_after_readiness_and_its_end_stops_the_server(tmp_path: Path) -> None:
    path, _port = write_group(tmp_path, server_delay=1.5, client_s=0.5)
    proc = supervise(path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "first try ok" in (tmp_path / "client.log").read_text()
    lines = out.splitlines()
    assert lines.index("rlfleet-group: role srv ready") < next(
        i for i, line in enumerate(lines) if line.startswith("rlfleet-group: role client started")
    )
    assert "rlfleet-group: role srv stopped" in lines
    assert not alive(int((tmp_path / "server.pid").read_text()))
    states = json.loads((tmp_path / "roles.json").read_text())
    assert states["client"]["state"] == "exited" and states["client"]["exit_code"] == 0
    assert states["srv"]["state"] == "stopped"
    assert states["srv"]["pid"] == int((tmp_path / "server.pid").read_text())


def test_readiness_and_roles_reach_the_group_past_a_proxy_with_the_token(tmp_path: Path) -> None:
    """Given the attempt's token in the supervisor's environment (as the launch gives it)
    and a proxy that answers nothing (`http_proxy`, as a VM's ~/.rlfleet/env may set for
    downloads): the readiness check goes straight to the server with the token, and the
    roles are told (`no_proxy`) to reach the group's addresses directly too."""
    path, _port = write_group(tmp_path, server_delay=0.5, client_s=0.2)
    dead = f"http://127.0.0.1:{free_port()}"
    env = {"RLFLEET_GROUP_TOKEN": "ab" * 16, "http_proxy": dead, "HTTP_PROXY": dead}
    env |= {"no_proxy": "example.org", "NO_PROXY": "intranet.example"}
    proc = supervise(path, env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    log = (tmp_path / "client.log").read_text()
    assert "first try ok" in log
    # Both spellings name the user's hosts and the group's (Python reads the lower-case one).
    both = "example.org,intranet.example,127.0.0.1,localhost,::1"
    assert f"no_proxy={both} NO_PROXY={both}" in log
    assert "ab" * 16 not in out


def test_a_dead_server_stops_the_client_and_fails_with_its_code(tmp_path: Path) -> None:
    path, _port = write_group(tmp_path, server_delay=0, client_s=300)
    proc = supervise(path)
    client = int(wait_for(tmp_path / "client.pid"))
    server = int(wait_for(tmp_path / "server.pid"))
    os.kill(server, 9)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 137, out
    assert not alive(client)
    assert group_failure_line(out) == "role srv failed (exit 137)"


def test_a_server_never_ready_fails_with_the_reason(tmp_path: Path) -> None:
    path, _port = write_group(tmp_path, server_delay=300, client_s=0, timeout=1)
    proc = supervise(path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == NOT_READY_EXIT, out
    assert group_failure_line(out) == "role srv not ready after 1s"
    assert not (tmp_path / "client.log").exists()  # never started


def test_a_stopped_supervisor_stops_every_role(tmp_path: Path) -> None:
    path, _port = write_group(tmp_path, server_delay=0, client_s=300)
    proc = supervise(path)
    client = int(wait_for(tmp_path / "client.pid"))
    server = int(wait_for(tmp_path / "server.pid"))
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert not alive(client) and not alive(server)


def test_a_failed_groups_reason_keeps_the_role_and_why() -> None:
    """The poller's reason names the role (from the supervisor's line); the retry step keeps
    that part when it rewrites the status reason."""
    from scheduler.remote.probe import RemoteJobState
    from scheduler.verdicts import LiveJob, group_reason_detail, job_verdict

    tail = "rlfleet-group: role srv started, pid 9\nrlfleet-group: role srv not ready after 120s\n"
    verdict = job_verdict(LiveJob(1, 1, "running", 1, 42), RemoteJobState("exited", 94, tail))
    assert verdict is not None and verdict.reason == "exited 94: role srv not ready after 120s"
    assert group_reason_detail(verdict.reason) == "role srv not ready after 120s"
    assert group_reason_detail("exited 1") is None
    assert group_failure_line("rlfleet-group: role t failed (exit 3); stopping the group") == (
        "role t failed (exit 3)"
    )


def test_a_roles_exit_127_is_not_passed_on_as_a_broken_vm(tmp_path: Path) -> None:
    """126/127 from an attempt mark its VM unusable; a role's own 127 (a command its shell
    did not find) fails the group with 1, the reason still saying 127."""
    config = {
        "roles": [
            {
                "name": "t",
                "argv": [sys.executable, "-c", "raise SystemExit(127)"],
                "env": {},
                "primary": True,
                "depends_on": [],
            }
        ],
        "checks": {},
        "env": {},
    }
    (tmp_path / "group.json").write_text(json.dumps(config))
    proc = supervise(tmp_path / "group.json")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert group_failure_line(out) == "role t failed (exit 127)"


SPREAD_GROUP = REWARD_GROUP.replace(
    b"    ready: {http: /health, timeout: 30}\n",
    b"    ready: {http: /health, timeout: 30}\n    own_vm: true\n",
)


def test_a_role_on_its_own_vm_is_a_node_of_its_own_and_each_vm_runs_only_its_roles() -> None:
    """`own_vm: true`: the server is node 1 (one GPU: a VM is claimed through its GPUs),
    the trainer node 0; each VM's supervisor gets its own roles, on its own GPUs, and
    every role's address (its VM's) and ports; a dependency on the other VM is checked at
    that VM's address."""
    group = parse_text(SPREAD_GROUP)
    assert [(n.gpus, n.roles) for n in group.layout()] == [
        (3, (("trainer", 0),)),
        (1, (("reward", 0),)),
    ]
    assert group.node_of() == {"trainer": 0, "reward": 1}
    addresses = ["10.0.0.5", "10.0.0.9"]
    ports = {("reward", "http"): 41000}
    trainer_vm = group_launch(group, PLACE, ports, node=0, node_addresses=addresses)
    server_place = GroupPlace(**{**PLACE.__dict__, "address": "10.0.0.9", "gpus": ["GPU-z"]})
    server_vm = group_launch(group, server_place, ports, node=1, node_addresses=addresses)
    assert [r["name"] for r in trainer_vm.config["roles"]] == ["trainer"]
    assert [r["name"] for r in server_vm.config["roles"]] == ["reward"]
    assert trainer_vm.needs_entrypoint and not server_vm.needs_entrypoint
    assert trainer_vm.config["roles"][0]["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b,GPU-c"
    assert server_vm.config["roles"][0]["env"]["CUDA_VISIBLE_DEVICES"] == ""
    for launch in (trainer_vm, server_vm):
        assert launch.config["env"] == {
            "RLFLEET_REWARD_ADDR": "10.0.0.9",
            "RLFLEET_REWARD_HTTP": "41000",
            "RLFLEET_TRAINER_ADDR": "10.0.0.5",
        }
        assert launch.config["checks"]["reward"]["host"] == "10.0.0.9"


def test_a_stored_group_over_vms_is_checked_against_its_layout() -> None:
    """`jobs.roles` of a group with an own-VM role needs `nodes` = its VMs and
    `gpus_requested` = every node's GPUs, a role on several nodes counting each of its."""
    from scheduler.rowcheck import roles_problem

    roles = parse_text(SPREAD_GROUP).to_data()
    assert roles_problem(roles, 4, 2) is None
    assert roles_problem(roles, 3, 2) == "roles need 4 GPUs, the row asks for 3"
    assert roles_problem(roles, 4, 1) == "roles run on 2 VM(s), the row asks for 1"
    one = {"roles": {"t": {"command": ["x"], "gpus": 1, "nodes": 2, "primary": True}}}
    assert roles_problem(one, 2, 2) is None
    assert roles_problem(one, 1, 2) == "roles need 2 GPUs, the row asks for 1"
    assert roles_problem(one, 2, 1) == "roles run on 2 VM(s), the row asks for 1"


def test_vllm_server_on_its_own_vm_serves_at_its_vms_address() -> None:
    """`vllm_server_own_vm: true`: the trainer is node 0 and `vllm` node 1 (its 2 GPUs);
    the server binds its own VM's address and the trainer reaches it there, on both
    ports."""
    group = parse_text(
        b"vllm_server_gpus: 2\nvllm_server_own_vm: true\n"
        b"roles:\n  trainer:\n    gpus: 1\n    train: {model: m, dataset: d, "
        b"reward_functions: [format]}\n"
    )
    assert [(n.gpus, n.roles) for n in group.layout()] == [
        (1, (("trainer", 0),)),
        (2, (("vllm", 0),)),
    ]
    ports = {("vllm", "http"): 40001, ("vllm", "nccl"): 40002}
    addresses = ["10.0.0.5", "10.0.0.9"]
    vm1 = GroupPlace(**{**PLACE.__dict__, "address": "10.0.0.9", "gpus": ["GPU-x", "GPU-y"]})
    server = group_launch(group, vm1, ports, node=1, node_addresses=addresses).config
    trainer_place = GroupPlace(**{**PLACE.__dict__, "gpus": ["GPU-a"]})
    trainer = group_launch(group, trainer_place, ports, node=0, node_addresses=addresses)
    (vllm,) = server["roles"]
    (train,) = trainer.config["roles"]
    assert vllm["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-x,GPU-y"
    assert "10.0.0.9" in [expand(w, server["env"]) for w in vllm["argv"]]
    words = [expand(w, trainer.config["env"]) for w in train["argv"]]
    host = words.index("--vllm_server_host")
    assert words[host + 1 : host + 6] == [
        "10.0.0.9", "--vllm_server_port", "40001", "--vllm_group_port", "40002",
    ]  # fmt: skip
    assert trainer.config["checks"]["vllm"]["host"] == "10.0.0.9"
    with pytest.raises(BadInput, match="vllm_server_own_vm: only with vllm_server_gpus"):
        parse_text(b"vllm_server_own_vm: true\nroles: {t: {command: [x], gpus: 1}}\n")


MULTINODE_GROUP = b"""
roles:
  reward:
    command: [python, examples/reward_server.py, --host, $RLFLEET_REWARD_ADDR]
    ports: [http]
    ready: {http: /health}
  trainer:
    gpus: 2
    nodes: 2
    depends_on: [reward]
    train:
      model: tiny
      dataset: data.jsonl
      reward_functions: rewards.http:remote_score
  sandbox:
    command: [sandbox, --rank, $RLFLEET_NODE_RANK]
    gpus: 0
    nodes: 3
    own_vm: true
"""


def test_a_role_on_several_nodes_runs_one_rank_per_vm_of_the_layout() -> None:
    """Node r runs rank r of every shared role with more than r nodes (the server beside
    rank 0 of the trainer); an own-VM role on 3 nodes gets 3 VMs of its own. Ports are
    chosen on the VM of each role's rank 0, with a rendezvous port for a role on several
    nodes."""
    from scheduler.jobspec import RENDEZVOUS_PORT

    group = parse_text(MULTINODE_GROUP)
    assert [(n.gpus, n.roles) for n in group.layout()] == [
        (2, (("reward", 0), ("trainer", 0))),
        (2, (("trainer", 1),)),
        (1, (("sandbox", 0),)),
        (1, (("sandbox", 1),)),
        (1, (("sandbox", 2),)),
    ]
    assert group.nodes_of() == {"reward": (0,), "trainer": (0, 1), "sandbox": (2, 3, 4)}
    assert group.node_of() == {"reward": 0, "trainer": 0, "sandbox": 2}
    assert node_port_needs(group) == [
        [("reward", "http"), ("trainer", RENDEZVOUS_PORT)],
        [],
        [("sandbox", RENDEZVOUS_PORT)],
        [],
        [],
    ]


def test_each_rank_of_a_role_on_several_nodes_is_told_where_it_stands() -> None:
    """Rank 1 of the trainer starts through accelerate's multi-machine launcher as machine
    1 of 2, at rank 0's address and rendezvous port, with the multi-node job's variables;
    a command role's rank reads its own rank from them; every VM knows every role's
    address (its rank 0's) and checks the server at its VM."""
    from scheduler.jobspec import RENDEZVOUS_PORT

    group = parse_text(MULTINODE_GROUP)
    addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
    ports = {
        ("reward", "http"): 41000,
        ("trainer", RENDEZVOUS_PORT): 42000,
        ("sandbox", RENDEZVOUS_PORT): 43000,
    }
    node1 = GroupPlace(**{**PLACE.__dict__, "address": "10.0.0.2", "gpus": ["GPU-x", "GPU-y"]})
    launch = group_launch(group, node1, ports, node=1, node_addresses=addresses).config
    (trainer,) = launch["roles"]
    assert trainer["argv"][:21] == [
        "/opt/venv/bin/python", "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_machines", "2", "--machine_rank", "1",
        "--main_process_ip", "10.0.0.1", "--main_process_port", "42000",
        "--num_processes", "4", "--mixed_precision", "no", "--dynamo_backend", "no",
        "training/train_grpo.py", "--model", "tiny",
    ]  # fmt: skip
    assert trainer["env"] == {
        "CUDA_VISIBLE_DEVICES": "GPU-x,GPU-y",
        "RLFLEET_ROLE": "trainer",
        "RLFLEET_NODE_RANK": "1",
        "RLFLEET_NUM_NODES": "2",
        "RLFLEET_GPUS_PER_NODE": "2",
        "RLFLEET_NODE_ADDRS": "10.0.0.1,10.0.0.2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "42000",
        "WORLD_SIZE": "4",
    }
    assert trainer["depends_on"] == ["reward"]
    assert launch["checks"]["reward"]["host"] == "10.0.0.1"
    assert launch["env"] == {
        "RLFLEET_REWARD_ADDR": "10.0.0.1",
        "RLFLEET_REWARD_HTTP": "41000",
        "RLFLEET_TRAINER_ADDR": "10.0.0.1",
        "RLFLEET_SANDBOX_ADDR": "10.0.0.3",
    }
    node0 = GroupPlace(**{**PLACE.__dict__, "address": "10.0.0.1", "gpus": ["GPU-a", "GPU-b"]})
    first = group_launch(group, node0, ports, node=0, node_addresses=addresses).config
    assert [r["name"] for r in first["roles"]] == ["reward", "trainer"]
    assert first["roles"][1]["argv"][7] == "0"  # --machine_rank 0
    assert "RLFLEET_NODE_RANK" not in first["roles"][0]["env"]  # the server is one node
    node4 = GroupPlace(**{**PLACE.__dict__, "address": "10.0.0.5", "gpus": ["GPU-q"]})
    last = group_launch(group, node4, ports, node=4, node_addresses=addresses).config
    (sandbox,) = last["roles"]
    assert [expand(w, {**last["env"], **sandbox["env"]}) for w in sandbox["argv"]] == [
        "sandbox", "--rank", "2",
    ]  # fmt: skip
    assert sandbox["env"]["RLFLEET_NODE_ADDRS"] == "10.0.0.3,10.0.0.4,10.0.0.5"
    assert (sandbox["env"]["MASTER_ADDR"], sandbox["env"]["MASTER_PORT"]) == ("10.0.0.3", "43000")
    assert (sandbox["env"]["WORLD_SIZE"], sandbox["env"]["CUDA_VISIBLE_DEVICES"]) == ("3", "")


def test_a_group_that_would_span_too_many_vms_is_refused() -> None:
    """The VMs of a layout are bounded like a multi-node job's nodes."""
    with pytest.raises(BadInput, match="roles: the group would span 65 VMs, at most 64"):
        parse_data(
            {
                "roles": {
                    "t": {"command": ["x"], "gpus": 1, "nodes": 64, "primary": True},
                    "s": {"command": ["y"], "own_vm": True},
                }
            }
        )
