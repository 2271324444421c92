"""Job spec files: the whole file is validated, and every error is one line naming the field."""

from __future__ import annotations

import re
from typing import Any

import pytest

from scheduler.errors import BadInput
from scheduler.jobspec import load_file, parse_data, parse_text
from scheduler.validate import MAX_ENV_VALUE, check_int, env_problem

GROUP = b"""
name: grpo-with-reward
max_retries: 2
roles:
  trainer:
    gpus: 2
    train:
      model: Qwen/Qwen2.5-0.5B-Instruct
      dataset: openai/gsm8k
      reward_functions: [rewards.http:remote_score, format]
      args: ["--max_steps", 50]
    depends_on: [reward]
    same_vm_as: reward
    env: {WANDB_MODE: offline}
  reward:
    command: python examples/reward_server.py --port "$PORT"
    ports: [http]
    ready: {http: /health, timeout: 30}
"""


def test_a_group_file_is_read_whole_with_its_defaults() -> None:
    spec = parse_text(GROUP)
    assert spec.name == "grpo-with-reward" and spec.max_retries == 2 and spec.priority == 0
    assert spec.start_order() == ("reward", "trainer")
    trainer, reward = spec.role("trainer"), spec.role("reward")
    assert trainer.primary and not reward.primary  # the training role is primary by default
    assert trainer.gpus == 2 and reward.gpus == 0
    assert trainer.train is not None and trainer.train.args == ("--max_steps", "50")
    assert trainer.train.reward_functions == ("rewards.http:remote_score", "format")
    # A command string is split into words, never given to a shell.
    assert reward.command == ("python", "examples/reward_server.py", "--port", "$PORT")
    assert reward.ready is not None and reward.ready.port == "http"
    assert reward.ready.path == "/health" and reward.ready.timeout_s == 30
    assert spec.start_order() == ("reward", "trainer")
    # Env values are secrets: the stored roles keep none (they go to the job's env file).
    assert trainer.env == (("WANDB_MODE", "offline"),) and "offline" not in str(spec.to_data())


def test_a_lone_command_role_is_primary() -> None:
    spec = parse_data({"roles": {"job": {"command": ["python", "x.py"], "gpus": 1}}})
    assert spec.roles[0].primary


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"roles": {"vllm": {"command": ["x"], "gpus": 65}}},
            "roles.vllm.gpus: must be an integer 0..64",
        ),
        (
            {"roles": {"vllm": {"command": ["x"], "gpus": 10**100}}},
            "roles.vllm.gpus: must be an integer",
        ),
        (
            {"roles": {"vllm": {"command": ["x"], "gpus": True}}},
            "roles.vllm.gpus: must be an integer",
        ),
        (
            {
                "roles": {
                    "t": {
                        "train": {"model": "m", "dataset": "d", "reward_functions": "r"},
                        "gpus": 0,
                    }
                }
            },
            "roles.t.gpus: must be an integer 1..64",
        ),
        ({"roles": {"Bad": {"command": ["x"]}}}, "roles.Bad: Bad is not a name"),
        ({"roles": {"a": {"command": ["x"], "colour": 1}}}, "roles.a.colour: unknown key"),
        ({"roles": {"a": {"command": ["x"]}}, "extra": 1}, "job file.extra: unknown key"),
        (
            {"roles": {"a": {"command": ["x"], "train": {}}}},
            "roles.a: give exactly one of command or train",
        ),
        ({"roles": {"a": {}}}, "roles.a: give exactly one of command or train"),
        ({"roles": {}}, "roles: at least one role is needed"),
        ({"roles": {"a": {"command": []}}}, "roles.a.command: must not be empty"),
        ({"roles": {"a": {"command": "x 'unclosed"}}}, "roles.a.command: cannot split it"),
        (
            {"roles": {"a": {"command": ["x"], "ports": ["HTTP"]}}},
            "roles.a.ports[0]: HTTP is not a name",
        ),
        (
            {"roles": {"a": {"command": ["x"], "ports": ["p", "p"]}}},
            "roles.a.ports: a port name is given twice",
        ),
        (
            {"roles": {"a": {"command": ["x"], "ready": {"http": "/h"}}}},
            "roles.a.ready: the role has no ports",
        ),
        (
            {"roles": {"a": {"command": ["x"], "ports": ["p"], "ready": {"tcp": "q"}}}},
            "roles.a.ready: q is not one of",
        ),
        (
            {"roles": {"a": {"command": ["x"], "ports": ["p"], "ready": {"http": "h"}}}},
            "roles.a.ready.http: must be a path",
        ),
        (
            {
                "roles": {
                    "a": {"command": ["x"], "ports": ["p"], "ready": {"tcp": "p", "timeout": 0}}
                }
            },
            "roles.a.ready.timeout: must be an integer 1..3600",
        ),
        (
            {"roles": {"a": {"command": ["x"], "depends_on": ["b"]}}},
            "roles.a.depends_on[0]: no other role b",
        ),
        (
            {"roles": {"a": {"command": ["x"], "same_vm_as": "a"}}},
            "roles.a.same_vm_as: no other role a",
        ),
        (
            {
                "roles": {
                    "a": {"command": ["x"], "depends_on": ["b"], "primary": True},
                    "b": {"command": ["y"], "depends_on": ["a"]},
                }
            },
            "roles.a.depends_on: a dependency cycle",
        ),
        ({"roles": {"a": {"command": ["x"]}, "b": {"command": ["y"]}}}, "roles: no primary role"),
        ({"roles": {"a": {"command": ["x"], "env": {"RLFLEET_X": "1"}}}}, "roles.a.env.RLFLEET_X:"),
        (
            {"roles": {"a": {"command": ["x"], "env": {"K": "a\nb"}}}},
            "roles.a.env.K: the value must be one line",
        ),
        (
            {"roles": {"a": {"command": ["x"], "primary": "yes"}}},
            "roles.a.primary: must be true or false",
        ),
        (
            {
                "roles": {
                    "a": {"command": ["x"], "ports": ["b_c"], "primary": True},
                    "a_b": {"command": ["y"], "ports": ["c"]},
                }
            },
            "roles.a_b.ports[0]: RLFLEET_A_B_C would also name roles.a.ports[0]",
        ),
        (
            {"roles": {"a": {"command": ["x"], "ports": ["addr"]}}},
            "roles.a.ports[0]: RLFLEET_A_ADDR would also name roles.a",
        ),
        (
            {"roles": {"node": {"command": ["x"], "ports": ["rank"]}}},
            "roles.node.ports[0]: RLFLEET_NODE_RANK would also name a variable the scheduler sets",
        ),
        (
            {"roles": {"job": {"command": ["x"], "ports": ["id"]}}},
            "roles.job.ports[0]: RLFLEET_JOB_ID would also name a variable the scheduler sets",
        ),
        (
            {
                "roles": {
                    "a": {"train": {"model": "m", "dataset": "d", "reward_functions": ["x,y"]}}
                }
            },
            "roles.a.train.reward_functions[0]: must not contain a comma",
        ),
        (
            {
                "roles": {
                    "a": {
                        "train": {
                            "model": "m",
                            "dataset": "d",
                            "reward_functions": ["r"],
                            "args": ["--model", "x"],
                        }
                    }
                }
            },
            "roles.a.train.args: --model in args sets --model",
        ),
        (
            {"roles": {"a": {"train": {"model": "m", "reward_functions": ["r"]}}}},
            "roles.a.train.dataset: required",
        ),
        (
            {"roles": {"a": {"command": ["x"]}}, "max_retries": 1001},
            "max_retries: must be an integer 0..1000",
        ),
        ({"roles": {"a": {"command": ["x\udcff"]}}}, "roles.a.command[0]: is not valid UTF-8"),
        (
            {
                "roles": {
                    "a": {"command": ["x"], "nodes": 40, "own_vm": True, "primary": True},
                    "b": {"command": ["y"], "nodes": 40},
                }
            },
            "roles: the group would span 80 VMs, at most 64",
        ),
        ("just text", "job file: must be a mapping"),
    ],
)
def test_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(BadInput) as caught:
        parse_data(data)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"roles: {a: {command: [\xff]}}", "job file: not valid UTF-8"),
        (b"roles: [unclosed", "job file: line 1: not valid YAML"),
        (b"a: &x [1]\nroles: *x\n", "job file: YAML aliases"),
        (
            b"roles:\n  a: !!python/object/apply:os.system [echo hi]\n",
            "job file: line 2: not valid YAML",
        ),
    ],
)
def test_bad_files_are_one_line(raw: bytes, message: str) -> None:
    with pytest.raises(BadInput) as caught:
        parse_text(raw)
    assert str(caught.value).startswith(message), str(caught.value)


def test_an_unreadable_or_huge_file_is_refused(tmp_path: object) -> None:
    import pathlib

    base = pathlib.Path(str(tmp_path))
    with pytest.raises(BadInput, match="cannot read it"):
        load_file(str(base / "missing.yaml"))
    big = base / "big.yaml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(BadInput, match="larger than"):
        load_file(str(big))


def test_the_readme_example_is_a_valid_file() -> None:
    import pathlib

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Job spec files", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    spec = parse_text(example.encode())
    assert spec.name == "gsm8k-grpo" and spec.role("trainer").gpus == 2


def test_the_reward_servers_own_knobs_can_be_set_in_a_roles_env() -> None:
    """rewards.http reads the role to call and its timeout from variables a job sets
    itself: a role's `env` (like `--env`) accepts them, so the documented knobs work."""
    from rewards.http import ROLE_ENV, TIMEOUT_ENV

    group = parse_data(
        {
            "roles": {
                "judge": {"command": ["x"], "ports": ["http"]},
                "trainer": {
                    "command": ["y"],
                    "gpus": 1,
                    "primary": True,
                    "env": {ROLE_ENV: "judge", TIMEOUT_ENV: 5},
                },
            }
        }
    )
    assert dict(group.env()) == {ROLE_ENV: "judge", TIMEOUT_ENV: "5"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # YAML 1.1 reads these as 60, 8, 10 and 90.0: a job file is read as YAML 1.2, where
        # they are text, and an integer field refuses them.
        (b"roles:\n  t: {command: [y], gpus: 1:00}\n", "roles.t.gpus: must be an integer"),
        (b"roles:\n  t: {command: [y], gpus: 0o10x}\n", "roles.t.gpus: must be an integer"),
        (b"roles:\n  t: {command: [y], gpus: 1_0}\n", "roles.t.gpus: must be an integer"),
        (b"priority: 1:30.0\nroles: {t: {command: [y]}}\n", "priority: must be an integer"),
        (b"priority: 1.5\nroles: {t: {command: [y]}}\n", "priority: must be an integer"),
        (
            b"roles:\n  t: {command: [y], gpus: " + b"9" * 5000 + b"}\n",
            "job file: line 2: a number",
        ),
        (b"roles:\n  t: {command: [" + b"1" * 5000 + b"]}\n", "job file: line 2: a number longer"),
        (b"roles:\n  t: {command: [1e" + b"9" * 5000 + b"]}\n", "roles.t.command[0]: must be text"),
        (b'roles:\n  "t\\n": {command: [y]}\n', "roles.'t\\n': 't\\n' is not a name"),
        (b'roles:\n  t: {command: [y], ports: ["p\\n"]}\n', "roles.t.ports[0]: 'p\\n'"),
        (b"roles: " + b"[" * 40000 + b"]" * 40000 + b"\n", "job file: line 1: nested deeper"),
        (
            b"roles:" + b"".join(b"\n" + b" " * i + b"- " for i in range(200)) + b"x\n",
            "job file: line 33: nested deeper",
        ),
    ],
)
def test_numbers_names_and_nesting_yaml_would_misread_are_one_line(
    raw: bytes, message: str
) -> None:
    with pytest.raises(BadInput) as caught:
        parse_text(raw)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_integers_are_read_as_yaml_1_2_gives_them() -> None:
    spec = parse_text(
        b"priority: 0x10\nmax_retries: 0o7\nroles:\n  t: {command: [y, 1:00, 010], gpus: +2}\n"
    )
    assert (spec.priority, spec.max_retries, spec.role("t").gpus) == (16, 7, 2)
    assert spec.role("t").command == ("y", "1:00", "10")


def test_deep_nesting_is_refused_in_bounded_time() -> None:
    """40,000 nested brackets took a minute of CPU to parse: the nesting is bounded while
    the file is read, so refusing it costs a few milliseconds."""
    import time

    started = time.process_time()
    with pytest.raises(BadInput, match="nested deeper"):
        parse_text(b"roles: " + b"[" * 400_000)
    assert time.process_time() - started < 1.0


def _trainer(train: dict[str, Any]) -> Any:
    group = parse_data({"roles": {"trainer": {"gpus": 1, "train": train}}})
    return group.role("trainer").train


def test_train_takes_a_recipes_keys_as_train_grpo_arguments():
    # `train:` takes what a `trl grpo --config` recipe holds: TRL's names for the model,
    # dataset and rewards, and any other field as an argument (before `args`, which win).
    train = _trainer(
        {
            "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct",
            "dataset_name": "d.jsonl",
            "reward_funcs": ["accuracy_reward", "my_lib.rewards.fn"],
            "loss_type": "dr_grpo",
            "gradient_checkpointing": True,
            "lora_target_modules": ["q_proj", "v_proj"],
            "model_init_kwargs": {"attn_implementation": "sdpa"},
            "learning_rate": "1e-5",
            "args": ["--seed", "3"],
        }
    )
    assert (train.model, train.dataset) == ("Qwen/Qwen2.5-0.5B-Instruct", "d.jsonl")
    assert train.reward_functions == ("accuracy_reward", "my_lib.rewards.fn")
    assert train.args == (
        "--loss_type", "dr_grpo", "--gradient_checkpointing", "true",
        "--lora_target_modules", "q_proj", "v_proj",
        "--model_init_kwargs", '{"attn_implementation": "sdpa"}',
        "--learning_rate", "1e-05", "--seed", "3",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"loss_typo": "x"}, "train: unknown key 'loss_typo' (did you mean loss_type?)"),
        ({"num_iterations": "two"}, "key num_iterations: expected int, got 'two'"),
        ({"output_dir": "/x"}, "output_dir is left out: the scheduler sets it"),
        ({"resume_from_checkpoint": True}, "resume_from_checkpoint is left out"),
        ({"model_name_or_path": "n"}, "give model once"),
        ({"env": {"A": "1"}}, "roles.trainer.train.env: give the job's variables"),
    ],
)
def test_bad_recipe_keys_in_train_name_the_key(train: dict[str, Any], message: str):
    base = {"model": "m", "dataset": "d", "reward_functions": ["r"]}
    with pytest.raises(BadInput, match=re.escape(message)):
        _trainer({**base, **train})


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b", "x" * (MAX_ENV_VALUE + 1)])
def test_a_job_file_refuses_the_env_values_a_job_row_refuses_in_the_same_words(value: str):
    """One rule for a job variable's value (`validate.env_value_problem`), whether it comes
    from a job file or from a job row."""
    row = env_problem({"K": value})
    assert row is not None and row.startswith("env K: ")
    with pytest.raises(BadInput) as caught:
        parse_data({"roles": {"a": {"command": ["x"], "env": {"K": value}}}})
    assert str(caught.value) == "roles.a.env.K: " + row.removeprefix("env K: ")


@pytest.mark.parametrize("field", ["priority", "max_retries"])
def test_a_boolean_is_no_integer_in_a_job_file_nor_on_the_command_line(field: str):
    with pytest.raises(BadInput, match=f"^{field}: must be an integer"):
        parse_data({field: True, "roles": {"a": {"command": ["x"]}}})
    with pytest.raises(BadInput, match="must be an integer$"):
        check_int(True, field)


def _with_reward(**reward: Any) -> dict[str, Any]:
    """A trainer and a reward server role, the server's keys given."""
    server = {"command": ["srv"], "ports": ["http"], "ready": {"http": "/health"}, **reward}
    return {"roles": {"reward": server, "trainer": {"command": ["t"], "primary": True}}}


def test_a_role_heals_in_place_only_when_it_says_so_and_keeps_it_when_stored() -> None:
    plain = parse_data(_with_reward()).role("reward")
    assert (plain.restart, plain.max_restarts) == ("never", 0)  # shared fate by default
    healing = parse_data(_with_reward(restart="on-failure")).role("reward")
    assert (healing.restart, healing.max_restarts) == ("on-failure", 3)
    spec = parse_data(_with_reward(restart="on-failure", max_restarts=0))
    assert spec.role("reward").max_restarts == 0
    stored = spec.to_data()
    assert stored["roles"]["reward"]["restart"] == "on-failure"
    assert parse_data(stored).role("reward") == spec.role("reward")
    assert "restart" not in parse_data(_with_reward()).to_data()["roles"]["reward"]


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"restart": "always"}, "roles.reward.restart: must be one of never, on-failure"),
        ({"restart": ["on-failure"]}, "roles.reward.restart: must be one of never, on-failure"),
        ({"max_restarts": 2}, "roles.reward.max_restarts: only with restart: on-failure"),
        (
            {"restart": "on-failure", "max_restarts": 101},
            "roles.reward.max_restarts: must be an integer 0..100",
        ),
        (
            {"restart": "on-failure", "max_restarts": -1},
            "roles.reward.max_restarts: must be an integer 0..100",
        ),
        (
            {"restart": "on-failure", "max_restarts": True},
            "roles.reward.max_restarts: must be an integer 0..100",
        ),
        ({"restart": "on-failure", "nodes": 2}, "roles.reward.restart: only for a one-node role"),
        (
            {"restart": "on-failure", "primary": True},
            "roles.reward.restart: a primary role is not restarted in place",
        ),
    ],
)
def test_a_bad_restart_policy_names_the_field(reward: dict[str, Any], message: str) -> None:
    with pytest.raises(BadInput) as caught:
        parse_data(_with_reward(**reward))
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_lone_role_is_primary_and_so_never_restarts_in_place() -> None:
    with pytest.raises(BadInput, match=r"^roles.a.restart: a lone role is the primary role"):
        parse_data({"roles": {"a": {"command": ["x"], "restart": "on-failure"}}})
