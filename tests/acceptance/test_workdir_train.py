"""train_grpo.py with a job's workdir, end to end through the scheduler on the SSH test
fleet: `--reward-function my_rewards:brevity --dataset data/train.jsonl`, both only in the
workdir sent with the job, train the tiny model on a VM that had neither (real poller,
dispatcher, NATS, Postgres, SSH and training; only the GPU is simulated)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.transport import Transport
from scheduler.workdir import pack
from tests.acceptance.test_reward_role import training_fleet
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import CONFIG
from tests.workloads.support import new_job, run_to_the_end

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


async def test_train_grpo_runs_with_a_reward_module_and_dataset_from_the_workdir(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copy(ROOT / "training" / "data" / "arithmetic.jsonl", project / "data" / "train.jsonl")
    (project / "my_rewards.py").write_text(
        "def brevity(prompts, completions, **kwargs):\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
        "    return [1.0 / (1 + len(t)) for t in texts]\n"
    )
    fleet, poller = await training_fleet(sim_fleet, db, transport, 1)
    out = tmp_path / "out"
    job_id = await new_job(
        db, 1,
        ("--max_steps", str(STEPS), "--num_generations", "4",
         "--per_device_train_batch_size", "4", "--max_completion_length", "8",
         "--save_steps", str(STEPS)),
        model=str(tiny), dataset="data/train.jsonl", reward_functions=("my_rewards:brevity",),
        max_retries=0, output_dir=str(out), workdir=pack(project),
    )  # fmt: skip
    job = await run_to_the_end(db, nats.url, transport, poller, job_id, CONFIG)
    log = (Path(job.attempt_dir or "") / "train.log").read_text()
    assert job.status == "completed", (job.status_reason, log[-3000:])
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    key = "rewards/brevity/mean"
    scored = [entry[key] for entry in state["log_history"] if key in entry]
    assert len(scored) == STEPS and all(0 < s <= 1 for s in scored)
