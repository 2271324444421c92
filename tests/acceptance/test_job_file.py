"""`rlfleet job submit -f job.yaml`: the real CLI as a subprocess, real Postgres and NATS. A
bad file is exit 2 with one line naming the field and inserts nothing; a good one-role file
is the job its flags would give."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.acceptance.test_cli import snapshot
from tests.acceptance.test_cli_input import add_polled_vm, assert_one_line, env, rlfleet

__all__ = ["env"]

ONE_ROLE = """
name: from-a-file
priority: 5
max_retries: 1
roles:
  trainer:
    gpus: 2
    train:
      model: Qwen/Qwen2.5-0.5B-Instruct
      dataset: data/train.jsonl
      reward_functions: [correctness, format]
      args: [--max_steps, 7]
    env: {WANDB_MODE: offline}
"""


def write(tmp_path: pathlib.Path, text: str | bytes) -> str:
    """The spec file of a test."""
    path = tmp_path / "job.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


@pytest.mark.slow
def test_a_one_role_file_is_the_job_its_flags_give(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    add_polled_vm(env, "gpu-1", 2)
    submitted = rlfleet(env, "job", "submit", "-f", write(tmp_path, ONE_ROLE), "--json")
    assert submitted.returncode == 0 and submitted.stderr == "", submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    shown = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert (shown["name"], shown["gpus"], shown["max_retries"]) == ("from-a-file", 2, 1)
    assert shown["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and shown["dataset"] == "data/train.jsonl"
    assert shown["reward_function"] == "correctness,format"
    assert shown["extra_args"] == ["--max_steps", "7"] and shown["env_keys"] == ["WANDB_MODE"]


GROUP = """
name: a-group
roles:
  reward:
    command: python3 examples/reward_server.py
    ports: [http]
    ready: {http: /health}
    env: {SCORER_TOKEN: s3cret}
    restart: on-failure
  trainer:
    gpus: 2
    depends_on: [reward]
    train:
      model: m
      dataset: d.jsonl
      reward_functions: rewards.http:remote_score
"""


@pytest.mark.slow
def test_a_group_file_is_stored_with_its_roles_and_without_env_values(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    add_polled_vm(env, "gpu-1", 2)
    submitted = rlfleet(env, "job", "submit", "-f", write(tmp_path, GROUP), "--json")
    assert submitted.returncode == 0 and submitted.stderr == "", submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    shown = rlfleet(env, "job", "show", job_id, "--json", "--no-progress")
    data = json.loads(shown.stdout)
    assert (data["gpus"], data["nodes"], data["model"]) == (2, 1, "m")
    assert data["env_keys"] == ["SCORER_TOKEN"] and "s3cret" not in shown.stdout
    roles = {r["name"]: r for r in data["roles"]}
    assert roles["reward"]["ports"] == {"http": None} and not roles["reward"]["primary"]
    assert roles["trainer"]["primary"] and roles["trainer"]["depends_on"] == ["reward"]
    assert roles["trainer"]["state"] == "queued"
    assert (roles["reward"]["restart"], roles["reward"]["max_restarts"]) == ("on-failure", 3)
    assert roles["reward"]["restarts"] == 0 and roles["trainer"]["restart"] == "never"
    table = rlfleet(env, "job", "show", job_id, "--no-progress").stdout
    assert "roles:" in table and "http=-" in table
    header = next(line for line in table.splitlines() if line.startswith("ROLE"))
    reward = next(line for line in table.splitlines() if line.startswith("reward "))
    assert header.split()[-1] == "RESTARTS" and reward.endswith("0 of 3"), table
    missing = rlfleet(env, "job", "logs", job_id, "--role", "judge")
    assert_one_line(missing, 2, f"job {job_id} has no role judge (roles: reward, trainer)")


@pytest.mark.slow
def test_the_vllm_flag_submits_a_group_of_the_server_and_the_trainer(
    env: dict[str, str],
) -> None:
    add_polled_vm(env, "gpu-1", 4)
    submitted = rlfleet(
        env, "job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "format",
        "--gpus", "2", "--vllm-server-gpus", "2", "--json", "--", "--max_steps", "5",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    data = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert data["gpus"] == 4
    assert [r["name"] for r in data["roles"]] == ["vllm", "trainer"]
    assert data["roles"][0]["command"] == ["vllm-serve"]
    refused = rlfleet(
        env, "job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "format",
        "--vllm-server-gpus", "1", "--", "--vllm_mode", "colocate",
    )  # fmt: skip
    assert_one_line(refused, 2, "argument 1 after --: --vllm_mode is set by the vLLM server mode")


@pytest.mark.slow
def test_own_vm_spreads_a_group_over_vms_and_the_vllm_flag_can_ask_for_it(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """A role with `own_vm: true` makes the group a job of two VMs (each node's GPUs
    together, a CPU-only server's VM claimed through one GPU), and
    `--vllm-server-own-vm` gives the `vllm` role a VM of its own."""
    add_polled_vm(env, "gpu-1", 2)
    add_polled_vm(env, "gpu-2", 2)
    spread = GROUP.replace("    env: {SCORER_TOKEN: s3cret}\n", "    own_vm: true\n")
    submitted = rlfleet(env, "job", "submit", "-f", write(tmp_path, spread), "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    data = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert (data["gpus"], data["nodes"]) == (3, 2)
    submitted = rlfleet(
        env, "job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "format",
        "--gpus", "2", "--vllm-server-gpus", "2", "--vllm-server-own-vm", "--json",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    data = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert (data["gpus"], data["nodes"]) == (4, 2)
    assert [r["name"] for r in data["roles"]] == ["vllm", "trainer"]
    alone = rlfleet(
        env, "job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "format",
        "--vllm-server-own-vm",
    )  # fmt: skip
    assert_one_line(alone, 2, "--vllm-server-own-vm: only with --vllm-server-gpus")
    too_big = rlfleet(
        env, "job", "submit", "--model", "m", "--dataset", "d", "--reward-function", "format",
        "--gpus", "2", "--vllm-server-gpus", "3", "--vllm-server-own-vm",
    )  # fmt: skip
    assert too_big.returncode == 2 and "could never run" in too_big.stderr, too_big.stderr


@pytest.mark.slow
def test_a_role_on_several_nodes_spreads_a_group_rank_by_rank(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """A role with `nodes: 2` beside others runs rank 1 on a VM of its own, and so does
    the trainer of `--nodes 2 --vllm-server-gpus 1` (the server beside rank 0): `job show`
    lists each rank of the role; `--vllm-server-own-vm` then needs a third VM."""
    add_polled_vm(env, "gpu-1", 2)
    add_polled_vm(env, "gpu-2", 2)
    spread = GROUP.replace(
        "    gpus: 2\n    depends_on", "    gpus: 2\n    nodes: 2\n    depends_on"
    )
    assert spread != GROUP
    submitted = rlfleet(env, "job", "submit", "-f", write(tmp_path, spread), "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    data = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert (data["gpus"], data["nodes"]) == (4, 2)
    assert [(r["name"], r["rank"]) for r in data["roles"]] == [
        ("reward", 0), ("trainer", 0), ("trainer", 1),
    ]  # fmt: skip
    table = rlfleet(env, "job", "show", job_id, "--no-progress").stdout
    assert "RANK" in table.split("roles:")[1]
    missing = rlfleet(env, "job", "logs", job_id, "--role", "trainer", "--node", "2")
    assert_one_line(missing, 2, f"job {job_id}: role trainer runs on 2 node(s); --node 0..1")
    flags = ("--model", "m", "--dataset", "d", "--reward-function", "format", "--gpus", "1")
    submitted = rlfleet(
        env, "job", "submit", *flags, "--nodes", "2", "--vllm-server-gpus", "1", "--json"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    data = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert (data["gpus"], data["nodes"]) == (3, 2)
    assert [(r["name"], r["rank"]) for r in data["roles"]] == [
        ("vllm", 0), ("trainer", 0), ("trainer", 1),
    ]  # fmt: skip
    third = rlfleet(
        env, "job", "submit", *flags, "--nodes", "2", "--vllm-server-gpus", "1",
        "--vllm-server-own-vm",
    )  # fmt: skip
    assert third.returncode == 2 and "could never run" in third.stderr, third.stderr


BAD_FILES = [
    (ONE_ROLE.replace("gpus: 2", "gpus: 65"), "roles.trainer.gpus: must be an integer 1..64"),
    (ONE_ROLE.replace("gpus: 2", "gpus: 99999999999999999999999"), "roles.trainer.gpus:"),
    (
        ONE_ROLE.replace("    gpus: 2", "    gpus: 2\n    colour: red"),
        "roles.trainer.colour: unknown key",
    ),
    (ONE_ROLE.replace("trainer:", "Trainer:"), "roles.Trainer: Trainer is not a name"),
    (b"roles: {a: {command: [\xff]}}", "not valid UTF-8"),
    (
        "roles:\n  a: {command: [x], depends_on: [b], primary: true}\n"
        "  b: {command: [y], depends_on: [a]}\n",
        "roles.a.depends_on: a dependency cycle",
    ),
    (
        "roles:\n  srv: {command: [x], ports: [http]}\n  t: {command: [y], primary: true}\n",
        "roles: a job needs at least one GPU",
    ),
    (
        "roles:\n  a: {command: [x], nodes: 40, own_vm: true}\n"
        "  t: {command: [y], gpus: 1, nodes: 30, primary: true}\n",
        "roles: the group would span 70 VMs, at most 64",
    ),
    (
        "roles:\n  a: {command: [x], own_vm: true, same_vm_as: t}\n"
        "  t: {command: [y], gpus: 1, primary: true}\n",
        "roles.a.same_vm_as: t or a has own_vm: true",
    ),
    # YAML 1.1 would read 1:00 as 60 (base 60); 5,000 digits are past Python's int limit.
    ("roles:\n  t: {command: [y], gpus: 1:00}\n", "roles.t.gpus: must be an integer"),
    (
        "roles:\n  t: {command: [y], gpus: " + "9" * 5000 + "}\n",
        "job.yaml: line 2: a number longer than 30 digits",
    ),
    ('roles:\n  "t\\n": {command: [y]}\n', "roles.'t\\n': 't\\n' is not a name"),
    (
        "roles: " + "[" * 40000 + "]" * 40000 + "\n",
        "job.yaml: line 1: nested deeper than 32 levels",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
@pytest.mark.slow
def test_a_bad_file_is_exit_2_one_line_and_inserts_nothing(
    env: dict[str, str], tmp_path: pathlib.Path, text: str | bytes, message: str
) -> None:
    before = snapshot(env["RLFLEET_DATABASE_URL"])
    result = rlfleet(env, "job", "submit", "-f", write(tmp_path, text))
    assert_one_line(result, 2, message)
    assert snapshot(env["RLFLEET_DATABASE_URL"]) == before


@pytest.mark.slow
def test_flags_a_file_gives_are_refused_beside_it(
    env: dict[str, str], tmp_path: pathlib.Path
) -> None:
    path = write(tmp_path, ONE_ROLE)
    assert_one_line(
        rlfleet(env, "job", "submit", "-f", path, "--gpus", "1"), 2, "give gpus in the file"
    )
    assert_one_line(rlfleet(env, "job", "submit", "-f", path, "--", "--x"), 2, "train arguments")
    assert_one_line(rlfleet(env, "job", "submit", "--model", "m"), 2, "missing option --dataset")
