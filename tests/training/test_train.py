"""Real CPU training runs of the tiny model through the real script: checkpoints, saving,
resuming and progress.json."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.training.helpers import tiny_run_args, train_grpo

# A user reward that varies with every sample, so that even two steps move the weights
# (keyword_match alone is often 0 for the whole group at the start: no advantage, no update).
LENGTH_REWARD = """
def length(prompts, completions, **kwargs):
    return [len(c[0]["content"]) / 40 for c in completions]
"""
TWO_STEP_ARGS = ["--max_steps", "2", "--save_steps", "1", "--save_total_limit", "0"]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding the user's reward module `lenmod.py`."""
    root = tmp_path_factory.mktemp("user")
    (root / "lenmod.py").write_text(LENGTH_REWARD)
    return root


@pytest.fixture(scope="module")
def two_steps(tiny_model: Path, user_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Output dir and stdout of a 2-step run that checkpoints every step."""
    out = tmp_path_factory.mktemp("two-steps")
    args = tiny_run_args(tiny_model, out, *TWO_STEP_ARGS, "--reward_function", "lenmod:length")
    result = train_grpo(*args, cwd=user_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def _state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


@pytest.mark.slow
def test_run_prints_a_one_line_summary(two_steps: tuple[Path, str]):
    out, stdout = two_steps
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("train-grpo: done after 2 steps, final mean reward ")
    assert summary.endswith(f"model saved to {out}")


@pytest.mark.slow
def test_progress_json_describes_the_finished_run(two_steps: tuple[Path, str]):
    progress = json.loads((two_steps[0] / "progress.json").read_text())
    assert progress["status"] == "finished"
    assert progress["step"] == 2 and progress["max_steps"] == 2 and progress["start_step"] == 0
    assert set(progress["rewards"]) == {"keyword_match", "length"}
    assert progress["reward"] == pytest.approx(sum(progress["rewards"].values()))
    assert isinstance(progress["loss"], float)
    assert progress["elapsed_s"] > 0 and progress["eta_s"] == 0.0
    assert not list(two_steps[0].glob(".progress.json.*")), "temporary file left behind"


@pytest.mark.slow
def test_checkpoints_every_save_step(two_steps: tuple[Path, str]):
    out = two_steps[0]
    assert [_state(out / f"checkpoint-{n}")["global_step"] for n in (1, 2)] == [1, 2]


@pytest.mark.slow
def test_final_model_and_tokenizer_load_and_differ_from_the_start(
    two_steps: tuple[Path, str], tiny_model: Path
):
    out = two_steps[0]
    trained = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert tokenizer.chat_template is not None and tokenizer.eos_token == "<|im_end|>"
    changed = [
        name
        for (name, a), (_, b) in zip(
            trained.named_parameters(), initial.named_parameters(), strict=True
        )
        if not torch.equal(a, b)
    ]
    assert changed, "training did not change any weight"
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    generated = trained.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1]


@pytest.mark.slow
def test_resume_auto_continues_the_step_count(
    two_steps: tuple[Path, str], tiny_model: Path, user_dir: Path, tmp_path: Path
):
    out = tmp_path / "resumed"
    shutil.copytree(two_steps[0], out)
    progress_file = tmp_path / "attempt-2" / "progress.json"
    args = tiny_run_args(
        tiny_model, out, "--max_steps", "4", "--save_steps", "1", "--resume", "auto"
    )
    result = train_grpo(
        *args,
        "--reward_function",
        "lenmod:length",
        cwd=user_dir,
        env={"RLFLEET_PROGRESS_FILE": str(progress_file)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    progress = json.loads(progress_file.read_text())
    assert (progress["start_step"], progress["step"]) == (2, 4), progress
    state = _state(out / "checkpoint-4")
    assert state["global_step"] == 4
    logged_steps = [entry["step"] for entry in state["log_history"] if "reward" in entry]
    assert logged_steps == [1, 2, 3, 4]
    # The attempt's progress went to the scheduler's file; the old one was left alone.
    assert json.loads((out / "progress.json").read_text())["step"] == 2
    assert "done after 4 steps" in result.stdout


@pytest.mark.slow
def test_lora_deepseek_run_with_weighted_rewards_saves_a_merged_model(
    tiny_model: Path, user_dir: Path, tmp_path: Path
):
    out = tmp_path / "lora"
    args = tiny_run_args(
        tiny_model, out, "--max_steps", "1", "--lora_r", "4", "--preprocess", "deepseek"
    )
    # `length` scores every completion above 0, so its weight shows in the logged total; the
    # other two are often 0 for a tiny model and could not tell weighted from unweighted.
    args += ["--reward_function", "xml_count", "lenmod:length", "--reward_weights", "1", "2", "0.5"]
    result = train_grpo(*args, cwd=user_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    progress = json.loads((out / "progress.json").read_text())
    rewards = progress["rewards"]
    assert set(rewards) == {"keyword_match", "xml_count", "length"}
    assert rewards["length"] > 0, progress
    # TRL logs the weighted sum as `reward`: the weights reached the trainer.
    weighted = rewards["keyword_match"] + 2 * rewards["xml_count"] + 0.5 * rewards["length"]
    assert progress["reward"] == pytest.approx(weighted, rel=1e-4), progress
    assert progress["reward"] != pytest.approx(sum(rewards.values()), rel=1e-4), progress


def test_console_script_is_installed():
    result = subprocess.run(
        [str(Path(__import__("sys").executable).parent / "train-grpo"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "--lora_r" in result.stdout
