"""The reward-server example as a job group, end to end through the scheduler on the SSH test
fleet: examples/reward_group.yaml (a `reward` role running examples/reward_server.py and a
trainer role running train_grpo.py with `rewards.http:remote_score`) on the tiny model. The
server scores every completion over HTTP, training learns from those scores, the job
completes and the server is stopped. Real poller, dispatcher, NATS, Postgres, SSH and
training; only the GPU is simulated (training runs on the CPU)."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import yaml

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.jobspec import parse_data
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import CONFIG, no_gpu_or_port_held, nothing_left
from tests.workloads.support import alive, new_job, run_to_the_end

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def example_roles(tiny_model: Path) -> dict[str, object]:
    """examples/reward_group.yaml with this checkout's paths, the tiny model and a short,
    fast CPU run; everything else as the example says."""
    data = yaml.safe_load((ROOT / "examples" / "reward_group.yaml").read_text())
    reward = data["roles"]["reward"]
    reward["command"] = [sys.executable, str(ROOT / "examples" / "reward_server.py")] + reward[
        "command"
    ][2:]
    train = data["roles"]["trainer"]["train"]
    assert train["reward_functions"] == ["rewards.http:remote_score"]
    train["model"] = str(tiny_model)
    train["dataset"] = str(ROOT / "training" / "data" / "arithmetic.jsonl")
    train["args"] = [
        "--max_steps", str(STEPS), "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--max_completion_length", "8",
        "--learning_rate", "3e-3", "--save_steps", str(STEPS),
    ]  # fmt: skip
    return parse_data(data).to_data()


async def training_fleet(
    sim_fleet: Callable[..., Awaitable[SimFleet]], db: Database, transport: Transport, count: int
) -> tuple[SimFleet, GpuPoller]:
    """`count` one-GPU VMs that run the real training entrypoint offline (no hub
    downloads, one CPU thread), registered, and a poller that has swept them once."""
    fleet = await sim_fleet(count, gpus_per_vm=1)
    for vm in fleet:
        vm.write_vm_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    await fleet.register(db, entrypoint="training.train_grpo")
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    return fleet, poller


async def test_the_reward_server_example_runs_as_a_role_end_to_end(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    fleet, poller = await training_fleet(sim_fleet, db, transport, 1)
    roles = example_roles(tiny)
    job_id = await new_job(
        db,
        1,
        roles=roles,
        model=str(tiny),
        dataset="arithmetic.jsonl",
        reward_functions=("rewards.http:remote_score",),
        max_retries=0,
        output_dir=str(tmp_path / "out"),
    )
    job = await run_to_the_end(db, nats.url, transport, poller, job_id, CONFIG)
    folder = Path(job.attempt_dir or "")
    trainer_log = (folder / "trainer.log").read_text()
    assert job.status == "completed", (job.status_reason, trainer_log[-3000:])
    reward_log = (folder / "reward.log").read_text()
    # One score request per step (4 completions each), all answered by the server role.
    assert f"reward server stopped after {STEPS} score requests" in reward_log, reward_log
    state = json.loads(
        (tmp_path / "out" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text()
    )
    logged = [e["rewards/remote_score/mean"] for e in state["log_history"] if "reward" in e]
    assert len(logged) == STEPS
    train_log = (folder / "train.log").read_text()
    pid = int(train_log.split("rlfleet-group: role reward started, pid ")[1].split()[0])
    assert not alive(pid) and "rlfleet-group: role reward stopped" in train_log
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)
