"""`rlfleet job submit --config RECIPE.yaml`: a recipe in `trl grpo --config`'s format goes
with the job. Through the real CLI (real Postgres and NATS) the job row holds the recipe's
model, dataset, rewards and arguments, and the keys the scheduler owns are left out with a
warning; on the SSH test fleet the same recipe trains the tiny model to completion (real
poller, dispatcher, SSH and training; only the GPU is simulated)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.transport import Transport
from tests.acceptance.test_cli_input import add_polled_vm, assert_one_line, env, rlfleet
from tests.acceptance.test_reward_role import training_fleet
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import CONFIG, no_gpu_or_port_held, nothing_left
from tests.training.test_recipe import CLI_OVERRIDES, write_recipe
from tests.workloads.support import new_job, run_to_the_end

__all__ = ["env"]

pytestmark = pytest.mark.slow

OWNED = "output_dir: /elsewhere\nresume_from_checkpoint: true\nenv:\n  RECIPE_VAR: 'on'\n"


def test_submit_config_stores_the_recipe_with_the_job(env: dict[str, str], tmp_path: Path):
    add_polled_vm(env, "gpu-1", 1)
    recipe = write_recipe(tmp_path / "recipe.yaml", Path("/models/tiny"))
    recipe.write_text(recipe.read_text() + OWNED)
    submitted = rlfleet(
        env, "job", "submit", "--config", str(recipe), "--json", "--", "--seed", "9"
    )
    assert submitted.returncode == 0, submitted.stderr
    warnings = submitted.stderr.splitlines()
    assert len(warnings) == 2, warnings
    assert "output_dir is left out: the scheduler sets it" in warnings[0]
    assert "resume_from_checkpoint is left out" in warnings[1]
    job_id = str(json.loads(submitted.stdout)["id"])
    shown = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert shown["model"] == "/models/tiny" and shown["dataset"].endswith("arithmetic.jsonl")
    assert shown["reward_function"] == "rewards.keywords.keyword_match,think_format_reward"
    args = shown["extra_args"]
    assert args[args.index("--loss_type") + 1] == "dr_grpo"
    targets = args.index("--lora_target_modules") + 1
    assert args[targets : targets + 2] == ["q_proj", "v_proj"]
    assert args[-2:] == ["--seed", "9"]  # after the recipe's: the command line wins
    assert "--output_dir" not in args and "--resume" not in args
    assert shown["env_keys"] == ["RECIPE_VAR"]


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("loss_typo: dr_grpo\n", "unknown key 'loss_typo' (did you mean loss_type?)"),
        ("num_iterations: two\n", "key num_iterations: expected int, got 'two'"),
        ("[1, 2]\n", "expected a mapping of field names to values"),
    ],
)
def test_a_bad_recipe_is_exit_2_one_line_and_inserts_nothing(
    env: dict[str, str], tmp_path: Path, recipe: str, message: str
):
    path = tmp_path / "bad.yaml"
    path.write_text("model_name_or_path: m\ndataset_name: d\nreward_funcs: [r]\n" + recipe
                    if not recipe.startswith("[") else recipe)  # fmt: skip
    assert_one_line(rlfleet(env, "job", "submit", "--config", str(path)), 2, message)
    listed = json.loads(rlfleet(env, "job", "list", "--json").stdout)
    assert listed == []


async def test_a_trl_recipe_trains_through_the_scheduler_on_a_test_vm(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    from scheduler.cli.jobfile import from_recipe
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny)
    recipe.write_text(recipe.read_text() + OWNED)
    fleet, poller = await training_fleet(sim_fleet, db, transport, 1)
    # What `job submit --config recipe.yaml -- --seed 11 --top_p 0.9` puts in the job row.
    model, dataset, rewards, args, recipe_env = from_recipe(
        str(recipe), None, None, (), tuple(CLI_OVERRIDES)
    )
    out = tmp_path / "out"
    job_id = await new_job(
        db, 1, extra=args, model=model, dataset=dataset, reward_functions=rewards,
        max_retries=0, output_dir=str(out), env=recipe_env,
    )  # fmt: skip
    job = await run_to_the_end(db, nats.url, transport, poller, job_id, CONFIG)
    attempt = Path(job.attempt_dir or "")
    log = (attempt / "train.log").read_text()
    assert job.status == "completed", (job.status_reason, log[-3000:])
    assert (out / "model.safetensors").is_file() and (out / "adapter").is_dir()
    # Under the scheduler progress.json is the attempt's (RLFLEET_PROGRESS_FILE).
    assert json.loads((attempt / "progress.json").read_text())["status"] == "finished"
    assert list((out / "runs").rglob("events.out.tfevents.*"))
    ran_with = torch.load(out / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert (ran_with.loss_type, ran_with.num_iterations, ran_with.seed) == ("dr_grpo", 2, 11)
    assert ran_with.output_dir == str(out)  # the scheduler's, not the recipe's /elsewhere
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)
