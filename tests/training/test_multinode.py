"""Two nodes, one training run: train_grpo.py under `accelerate launch --num_machines 2`, each
rank a separate process tree with its own HOME and working directory (as on two VMs), gloo on
CPU. Both ranks train the same steps, rank 0 alone saves the model, every node keeps a
checkpoint it can resume from, and `--resume auto` agrees on one step across nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ports
from tests.training.helpers import REPO, _env, tiny_run_args

pytestmark = pytest.mark.slow

NODES = 2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rank-0 launcher binds it for the rendezvous)."""
    return ports.free_port()


def launch_argv(rank: int, port: int, train_args: list[str]) -> list[str]:
    """The launch line of one node: what the scheduler runs on the VM of node `rank`."""
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu",  # torchrun; on a machine without CUDA the script joins a gloo group
        "--num_machines", str(NODES),
        "--machine_rank", str(rank),
        "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(port),
        "--num_processes", str(NODES),  # all machines together: NODES x 1 process
        "--mixed_precision", "no",
        "--dynamo_backend", "no",
        str(REPO / "training" / "train_grpo.py"),
        *train_args,
    ]  # fmt: skip


def node_env(rank: int, port: int, home: Path) -> dict[str, str]:
    """The environment the scheduler gives node `rank`."""
    return {
        "HOME": str(home),
        "RLFLEET_NODE_RANK": str(rank),
        "RLFLEET_NUM_NODES": str(NODES),
        "RLFLEET_GPUS_PER_NODE": "1",
        "RLFLEET_NODE_ADDRS": ",".join(["127.0.0.1"] * NODES),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(NODES),
    }


def run_nodes(root: Path, train_args: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Start every node's launcher at once, wait for all; node R lives in root/nR."""
    port = free_port()
    processes = []
    for rank in range(NODES):
        home, work = root / f"n{rank}" / "home", root / f"n{rank}" / "work"
        home.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        processes.append(
            subprocess.Popen(
                launch_argv(rank, port, train_args),
                cwd=work,
                env=_env(node_env(rank, port, home)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=400)
            results.append(
                subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            )
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return results


def progress(root: Path, rank: int) -> dict:
    return json.loads((root / f"n{rank}" / "work" / "out" / "progress.json").read_text())


def test_two_nodes_train_together_save_once_and_resume_from_a_common_step(
    tiny_model: Path, tmp_path: Path
):
    # A relative output_dir: each node writes under its own working directory, its own disk.
    args = tiny_run_args(tiny_model, Path("out"), "--save_steps", "2")
    outs = [tmp_path / f"n{rank}" / "work" / "out" for rank in range(NODES)]

    first = run_nodes(tmp_path, [*args, "--max_steps", "4"])
    for result in first:
        assert result.returncode == 0, result.stderr[-4000:]
    reports = [progress(tmp_path, rank) for rank in range(NODES)]
    assert [(p["status"], p["step"]) for p in reports] == [("finished", 4)] * NODES
    # Both report the rewards gathered over the whole run.
    assert reports[0]["rewards"] == reports[1]["rewards"]
    assert "done after 4 steps" in first[0].stdout and "model saved to out" in first[0].stdout
    assert "model saved by rank 0" in first[1].stdout
    assert (outs[0] / "model.safetensors").is_file() and (outs[0] / "tokenizer.json").is_file()
    assert not (outs[1] / "model.safetensors").exists() and not (outs[1] / "config.json").exists()
    for out in outs:  # Each node can resume from its own disk.
        for step in (2, 4):
            assert (out / f"checkpoint-{step}" / "model.safetensors").is_file(), sorted(
                p.name for p in (out / f"checkpoint-{step}").iterdir()
            )
            assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()

    # Node 1 lost its newest checkpoint (say the VM was replaced mid-save): both resume from 2.
    for path in sorted((outs[1] / "checkpoint-4").iterdir()):
        path.unlink()
    (outs[1] / "checkpoint-4").rmdir()
    second = run_nodes(tmp_path, [*args, "--max_steps", "6", "--resume", "auto"])
    for result in second:
        assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(NODES):
        state = progress(tmp_path, rank)
        assert (state["status"], state["start_step"], state["step"]) == ("finished", 2, 6), state
    trained = json.loads((outs[0] / "checkpoint-6" / "trainer_state.json").read_text())
    assert [e["step"] for e in trained["log_history"] if "reward" in e] == [1, 2, 3, 4, 5, 6]
    # One run, not two: each step took one prompt per process (4 completions each) from the 200
    # rows, so the epoch moved twice as far per step as a lone process would move it.
    assert trained["epoch"] == pytest.approx(6 * 2 / 200), "not one run of two processes"
