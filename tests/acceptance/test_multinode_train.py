"""A real distributed GRPO run across two VMs of the SSH test fleet: the scheduler claims
one GPU on each, launches `training/train_grpo.py` on the tiny model as 2 nodes × 1
process (accelerate's launcher, torchrun's rendezvous on the port chosen on rank 0's VM,
gloo on the CPU), and the job completes; then the same as the trainer role of a job group
beside the reward server example. Only the GPUs are simulated; nothing is faked in the
training."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.jobspec import parse_data
from scheduler.requeue import RequeueConfig
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.training.helpers import ARITHMETIC, REPO
from tests.workloads.support import job_nodes, new_job, run_to_the_end

pytestmark = pytest.mark.slow

FleetFactory = Callable[..., Awaitable[SimFleet]]
STEPS = 3
NOT_ONE_GROUP = "parallel_mode != ParallelMode.DISTRIBUTED"
"""transformers' warning when a process is in a torch process group its trainer ignores:
it then trains alone, as rank 0."""


async def test_train_grpo_runs_as_one_run_across_two_vms(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """2 nodes × 1 process of train_grpo.py for a few GRPO steps: both ranks report the
    same global step in their own progress.json, they train as one process group (no
    rank trains alone), the final model is saved once, by rank 0, and the job completes."""
    from training.tiny_model import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny-model")
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(
        db, entrypoint=str(REPO / "training" / "train_grpo.py"), python=sys.executable
    )
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    job_id = await new_job(
        db,
        1,
        (
            "--keywords", "hello", "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--max_completion_length", "8", "--max_steps", str(STEPS), "--save_steps", "100",
        ),
        nodes=2,
        max_retries=0,
        model=str(model),
        dataset=str(ARITHMETIC),
        reward_functions=("keyword_match",),
        env=(("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("OMP_NUM_THREADS", "1")),
    )  # fmt: skip
    config = RequeueConfig(interval_s=0.5, recheck_after_s=0.5)
    job = await run_to_the_end(db, nats.url, transport, poller, job_id, config, tick_s=1)
    nodes = await job_nodes(db, job_id)
    logs = [(Path(n.attempt_dir or "") / "train.log").read_text() for n in nodes]
    assert job.status == "completed", f"{job.status_reason}\n" + "\n".join(
        log[-3000:] for log in logs
    )
    assert [n.exit_code for n in nodes] == [0, 0] and nodes[0].vm_id != nodes[1].vm_id
    steps = [json.loads((Path(n.attempt_dir or "") / "progress.json").read_text()) for n in nodes]
    assert [p["step"] for p in steps] == [STEPS, STEPS]
    assert all(NOT_ONE_GROUP not in log for log in logs)
    assert "model saved by rank 0" in logs[1]
    homes = {vm.home for vm in fleet.vms}
    saved = sorted(
        str(path)
        for home in homes
        for path in home.rglob("model.safetensors")
        if not any(part.startswith("checkpoint-") for part in path.parts)
    )
    assert len(saved) == 1, saved  # the final model, once
    rank0_home = next(h for h in homes if h in Path(nodes[0].attempt_dir or "").parents)
    assert any(rank0_home.rglob("outputs/*/model.safetensors"))


async def test_a_trainer_role_on_two_vms_learns_from_the_reward_server_role(
    sim_fleet: FleetFactory,
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """examples/reward_group.yaml with its trainer role on 2 nodes: the reward server runs
    beside rank 0, train_grpo.py runs as one gloo process group over both VMs (the
    rendezvous port chosen on rank 0's VM for the role), both ranks score their own
    completions on the server over HTTP, the model is saved once, the job completes and the
    server is stopped. Only the GPUs are simulated; nothing is faked in the training."""
    from tests.acceptance.test_reward_role import STEPS as ROLE_STEPS
    from tests.acceptance.test_reward_role import example_roles, training_fleet
    from tests.integration.test_groups_fleet import CONFIG, no_gpu_or_port_held, nothing_left
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    fleet, poller = await training_fleet(sim_fleet, db, transport, 2)
    roles = example_roles(tiny)
    roles["roles"]["trainer"]["nodes"] = 2
    job_id = await new_job(
        db,
        2,
        nodes=2,
        roles=parse_data(roles).to_data(),
        model=str(tiny),
        dataset="arithmetic.jsonl",
        reward_functions=("rewards.http:remote_score",),
        max_retries=0,
    )
    job = await run_to_the_end(db, nats.url, transport, poller, job_id, CONFIG)
    nodes = await job_nodes(db, job_id)
    dirs = [Path(n.attempt_dir or "") for n in nodes]
    logs = [(d / "trainer.log").read_text() for d in dirs]
    assert job.status == "completed", f"{job.status_reason}\n" + "\n".join(
        log[-3000:] for log in logs
    )
    assert [n.exit_code for n in nodes] == [0, 0] and nodes[0].vm_id != nodes[1].vm_id
    steps = [json.loads((d / "progress.json").read_text())["step"] for d in dirs]
    assert steps == [ROLE_STEPS, ROLE_STEPS]
    assert all(NOT_ONE_GROUP not in log for log in logs)
    assert "model saved by rank 0" in logs[1]
    # One score request per step from each rank, all answered by the one server.
    reward_log = (dirs[0] / "reward.log").read_text()
    assert f"reward server stopped after {2 * ROLE_STEPS} score requests" in reward_log, reward_log
    assert not (dirs[1] / "reward.log").exists()
    saved = sorted(
        str(path)
        for vm in fleet
        for path in vm.home.rglob("model.safetensors")
        if not any(part.startswith("checkpoint-") for part in path.parts)
    )
    assert len(saved) == 1, saved  # the final model, once, by rank 0
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)
