"""Train a causal LM with GRPO on a prompt dataset and reward functions.

    train-grpo --model Qwen/Qwen2.5-0.5B-Instruct --dataset gsm8k.jsonl \\
        --reward_function correctness --reward_function strict_format --output_dir out

Also runs as `python -m training.train_grpo` and `python training/train_grpo.py`.
Exit codes: 0 done, 64 bad arguments or input, 75 transient failure, 143 stopped by SIGTERM
with a checkpoint; see training/errors.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a file: make `training` and `rewards` importable, and do not let this directory
    # shadow top-level modules.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from training.args import ScriptArguments, parse_args  # noqa: E402
from training.checkpoints import agree_on_resume, resolve_resume  # noqa: E402
from training.errors import EXIT_OK, EXIT_TERMINATED, exit_code_for, one_line  # noqa: E402
from training.model import require_unsloth, require_vllm  # noqa: E402
from training.reward_guard import ScoreTally  # noqa: E402
from training.reward_setup import build_rewards, reward_names  # noqa: E402
from trlspec.exits import ERROR_PREFIX  # noqa: E402


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports: where the model is, how far it got, its mean rewards."""

    output_dir: str
    global_step: int
    rewards: list[float]  # Mean reward at each logging step of this run, oldest first.
    max_steps: int = 0
    stopped: bool = False  # By SIGTERM, after saving checkpoint-<global_step>; no final model.
    saved_here: bool = True  # False on all but the first process of a distributed run.

    @property
    def final_reward(self) -> float | None:
        """The mean reward at the last logging step, if any."""
        return self.rewards[-1] if self.rewards else None


@contextmanager
def _quiet_until_training() -> Iterator[None]:
    """Hide the progress bars of datasets, transformers and the hub, and datasets' log lines,
    while inputs are loaded and checked.

    An exit-64 or exit-75 error must be the only line on stderr, yet loading draws "Generating
    train split", "Building prompts" and "Loading weights" bars, and datasets logs a parse error
    before raising it. Only imported after Unsloth, like everything that pulls in transformers.
    """
    import datasets
    from transformers.utils import logging as transformers_logging

    datasets_bars_were_off = datasets.are_progress_bars_disabled()
    transformers_bars_were_on = transformers_logging.is_progress_bar_enabled()
    datasets_verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()  # Also the hub's download bars.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(datasets_verbosity)
        if transformers_bars_were_on:
            transformers_logging.enable_progress_bar()
        if not datasets_bars_were_off:
            datasets.enable_progress_bars()


def _logs_in_output_dir(args: ScriptArguments) -> None:
    """Point the trackers that write locally at the output directory, so that their logs go
    with the job's output (and to its store). tensorboard writes to OUTPUT_DIR/runs itself.
    Before trl is imported: it imports trackio, which reads TRACKIO_DIR once."""
    names = args.report_to()
    if "trackio" in names or names == ["all"]:
        os.environ.setdefault("TRACKIO_DIR", str(Path(args.output_dir) / "trackio"))
    if "wandb" in names or names == ["all"]:
        os.environ.setdefault("WANDB_DIR", args.output_dir)


def run(args: ScriptArguments) -> TrainResult:
    """Check the cheap things first (rewards, resume, TRL's own checks of its configuration,
    what the machine lacks), then load data and model, train, save."""
    os.environ.update(args.env)  # A recipe's `env`, as `trl grpo` sets it.
    _logs_in_output_dir(args)
    if args.use_unsloth:
        require_unsloth()  # Before anything imports trl or transformers.
    if args.use_vllm:
        require_vllm()
    tally = ScoreTally(args.max_unscored_steps)
    rewards, required_columns = build_rewards(args, tally)
    checkpoint = resolve_resume(args.resume, args.output_dir)

    from training import model as loading
    from training.data import check_columns, load_mixture, load_raw_dataset, preprocess
    from training.trainer import build_config, check_environment

    check_environment(args)
    config = build_config(args)
    model_args = loading.model_config(args)
    init_kwargs = loading.model_init_kwargs(args, model_args)
    with _quiet_until_training():
        mixture = args.trl_group("mixture")

        def load(split: str) -> Any:
            if mixture.get("datasets"):
                return load_mixture(mixture, split)
            return load_raw_dataset(args.dataset, split, args.dataset_config)

        raw = load(args.dataset_split)
        # As `trl grpo`: evaluation (eval_strategy) runs on the dataset's dataset_test_split.
        evaluating = str(getattr(config.eval_strategy, "value", config.eval_strategy)) != "no"
        raw_eval = load(str(args.trl.get("dataset_test_split", "test"))) if evaluating else None
        if args.use_unsloth:
            model, tokenizer = loading.load_unsloth_model(args)
            peft_config = None
        else:
            tokenizer = loading.load_tokenizer(args.model)
            model, peft_config = None, loading.lora_config(args, model_args)
        conversational = tokenizer.chat_template is not None
        dataset = preprocess(raw, args.preprocess, conversational=conversational)
        check_columns(dataset, required_columns)
        eval_dataset = None
        if raw_eval is not None:
            eval_dataset = preprocess(raw_eval, args.preprocess, conversational=conversational)
            check_columns(eval_dataset, required_columns)
        if model is None:
            model = loading.load_model(args.model, **init_kwargs)

        from training.callbacks import NodeCheckpointCallback, ScoreCheckCallback, StopOnSigterm
        from training.progress import ProgressCallback, progress_path
        from training.trainer import build_trainer, logged_rewards, save_final

        names = reward_names(rewards)
        stop = StopOnSigterm()
        progress = ProgressCallback(progress_path(args.output_dir), names, lambda: stop.stopped)
        score_check = ScoreCheckCallback(tally, args.reward_function)
        callbacks = [score_check, stop, progress, NodeCheckpointCallback()]
        trainer = build_trainer(
            args, model, tokenizer, dataset, rewards, callbacks, peft_config, config, eval_dataset
        )
        stop.accelerator = score_check.accelerator = trainer.accelerator
        if trainer.accelerator.num_processes > 1:
            checkpoint = agree_on_resume(args.resume, args.output_dir, _gather)
    trainer.train(resume_from_checkpoint=checkpoint)
    if not stop.stopped:
        save_final(trainer, tokenizer, args.output_dir)
    state = trainer.state
    return TrainResult(
        args.output_dir,
        state.global_step,
        logged_rewards(trainer),
        state.max_steps,
        stop.stopped,
        saved_here=trainer.accelerator.is_main_process,
    )


def _gather(value: object) -> list[object]:
    """`value` from every process of the run, in rank order (a collective: all must call it)."""
    from accelerate.utils import gather_object

    return list(gather_object([value]))


def summary(result: TrainResult) -> str:
    """The one line printed when a run finishes (on stdout) or stops on SIGTERM (on stderr)."""
    if result.stopped:
        checkpoint = Path(result.output_dir) / f"checkpoint-{result.global_step}"
        return (
            f"train-grpo: stopped by SIGTERM after step {result.global_step} of "
            f"{result.max_steps}; checkpoint saved to {checkpoint} (--resume auto continues)"
        )
    reward = "n/a" if result.final_reward is None else f"{result.final_reward:.3f}"
    where = f"model saved to {result.output_dir}" if result.saved_here else "model saved by rank 0"
    return f"train-grpo: done after {result.global_step} steps, final mean reward {reward}; {where}"


def close_progress_bars() -> None:
    """Close the trainer's progress bar (on stderr), so that the line printed next is a line
    of its own and the bar does not redraw after it when the interpreter exits."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:
        for bar in list(getattr(tqdm.tqdm, "_instances", ())):
            bar.close()


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the process exit code."""
    args = parse_args(argv)
    try:
        result = run(args)
    except Exception as exc:
        code = exit_code_for(exc)
        if code is None:
            raise
        close_progress_bars()
        print(f"{ERROR_PREFIX}{one_line(exc)}", file=sys.stderr)
        return code
    if result.stopped:
        close_progress_bars()
        print(summary(result), file=sys.stderr)
        return EXIT_TERMINATED
    print(summary(result), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
