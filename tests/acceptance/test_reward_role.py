"""The reward-server example as a job group, end to end through the scheduler on the SSH test
fleet: examples/reward_group.yaml (a `reward` role running examples/reward_server.py and a
trainer role running train_grpo.py with `rewards.http:remote_score`) on the tiny model. The
server scores every completion over HTTP, training learns from those scores, the job
completes and the server is stopped; the server killed mid-run is restarted in place
(`restart: on-failure`) and the trainer completes with every reward scored. Real poller,
dispatcher, NATS, Postgres, SSH and training; only the GPU is simulated (training runs on
the CPU)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.gpu_poller import GpuPoller
from scheduler.jobspec import parse_data
from scheduler.transport import Transport
from tests.fleet import SimFleet
from tests.integration.test_groups_fleet import (
    CONFIG,
    group_token,
    health,
    no_gpu_or_port_held,
    nothing_left,
    restart_events,
)
from tests.workloads.support import alive, job_row, new_job, run_to_the_end, wait_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def example_roles(tiny_model: Path, steps: int = STEPS) -> dict[str, object]:
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
        "--max_steps", str(steps), "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--max_completion_length", "8",
        "--learning_rate", "3e-3", "--save_steps", str(steps),
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


def _port(reward_log: str) -> int:
    """The port the reward server said it listens on."""
    found = re.search(r"listening on \S+:(\d+)", reward_log)
    assert found is not None, reward_log
    return int(found.group(1))


async def test_a_reward_server_killed_mid_run_is_restarted_and_every_reward_is_scored(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """The example's reward role (`restart: on-failure`) killed (SIGKILL) once it has
    scored two steps: its supervisor starts it again at the same address and port, the
    trainer's requests meanwhile are asked again (rewards.http), and the trainer, never
    restarted, completes its run in the same attempt with a reward for every step; the
    restart is an event of the job."""
    from training.tiny_model import save_tiny_model

    tiny = save_tiny_model(tmp_path / "tiny-model")
    fleet, poller = await training_fleet(sim_fleet, db, transport, 1)
    await reward_restart_proof(db, nats, transport, poller, tiny, tmp_path, fleet)


async def reward_restart_proof(
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    poller: GpuPoller,
    tiny: Path,
    tmp_path: Path,
    fleet: Iterable[Any],
) -> None:
    """The restart proof on a registered one-VM training fleet (`fleet`: its VMs, each with
    `processes()`, as tests/fleet.py's and tests/sshd.py's have; `poller` has swept it)."""
    steps = 8
    roles = example_roles(tiny, steps)
    assert roles["roles"]["reward"]["restart"] == "on-failure"  # type: ignore[index]
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
    killed: list[int] = []

    async def kill_mid_run() -> None:
        """Once the server has answered two score requests, SIGKILL it."""
        while (where := (await job_row(db, job_id)).attempt_dir) is None:
            await asyncio.sleep(0.05)
        folder = Path(where)
        port = _port(await wait_file(folder / "reward.log", 120, "listening on "))
        token = group_token(folder)
        deadline = time.monotonic() + 300
        while (served := health(port, token)["requests"]) < 2:
            assert time.monotonic() < deadline, "the trainer never asked for scores"
            await asyncio.sleep(0.05)
        started = (folder / "train.log").read_text().split("role reward started, pid ")[1]
        pid = int(started.split()[0])
        assert pid > 1
        os.kill(pid, signal.SIGKILL)
        killed.extend([pid, served])

    killer = asyncio.create_task(kill_mid_run())
    try:
        job = await run_to_the_end(db, nats.url, transport, poller, job_id, CONFIG, tick_s=0.2)
    finally:
        killer.cancel()
    folder = Path(job.attempt_dir or "")
    trainer_log = (folder / "trainer.log").read_text()
    assert job.status == "completed", (job.status_reason, trainer_log[-3000:])
    assert killed and killed[1] < steps, "the server was not killed mid-run"
    assert (job.attempt, job.retry_count) == (1, 0)
    train_log = (folder / "train.log").read_text()
    assert train_log.count("role trainer started") == 1  # the trainer ran on
    assert "rlfleet-group: role reward restarted, pid " in train_log, train_log
    reward_log = (folder / "reward.log").read_text()
    ports = re.findall(r"listening on 127\.0\.0\.1:(\d+)", reward_log)
    assert len(ports) == 2 and len(set(ports)) == 1, reward_log  # the same port again
    # The new server scored the steps left after the kill (one may have been answered by
    # the old one between the test's count and the kill); every step has its reward.
    after = int(re.findall(r"reward server stopped after (\d+) score requests", reward_log)[-1])
    assert after >= 1 and killed[1] + after in (steps - 1, steps), (killed, after)
    state = json.loads(
        (tmp_path / "out" / f"checkpoint-{steps}" / "trainer_state.json").read_text()
    )
    logged = [e["rewards/remote_score/mean"] for e in state["log_history"] if "reward" in e]
    assert len(logged) == steps and all(isinstance(x, float) for x in logged), logged
    events = await restart_events(db, job_id)
    assert [reason for _to, reason, _a in events] == [
        "role reward restarted in place (1 of 3): it exited with 137"
    ]
    assert not alive(killed[0])
    await nothing_left(fleet)
    await no_gpu_or_port_held(db)
