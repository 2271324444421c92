"""main(): how failures inside a run become exit codes and one line on stderr."""

from __future__ import annotations

import pytest
import torch

from training import train_grpo
from training.errors import UsageError

ARGV = ["--model", "m", "--dataset", "d.jsonl", "--reward_function", "correctness"]


def _failing_with(exc: BaseException):
    def run(args: object) -> None:
        raise exc

    return run


@pytest.mark.parametrize(
    ("exc", "code", "line"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"), 75, "CUDA out"),
        (RuntimeError("CUDA out of memory.\nsee the docs"), 75, "CUDA out of memory."),
        (TimeoutError("read timed out"), 75, "read timed out"),
        (UsageError("dataset file not found: d.jsonl"), 64, "dataset file not found"),
    ],
)
def test_classified_failures_exit_with_their_code_and_one_line(
    exc: BaseException,
    code: int,
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    monkeypatch.setattr(train_grpo, "run", _failing_with(exc))
    assert train_grpo.main(ARGV) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("train-grpo: error: ") and line in err


def test_other_failures_propagate(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(train_grpo, "run", _failing_with(KeyError("bug")))
    with pytest.raises(KeyError):
        train_grpo.main(ARGV)


def test_success_prints_the_summary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    result = train_grpo.TrainResult("out", 12, [0.1, 0.75])
    monkeypatch.setattr(train_grpo, "run", lambda args: result)
    assert train_grpo.main(ARGV) == 0
    assert capsys.readouterr().out == (
        "train-grpo: done after 12 steps, final mean reward 0.750; model saved to out\n"
    )


def test_a_run_stopped_by_sigterm_exits_143_and_says_where_its_checkpoint_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    result = train_grpo.TrainResult("out", 7, [0.5], max_steps=100, stopped=True)
    monkeypatch.setattr(train_grpo, "run", lambda args: result)
    assert train_grpo.main(ARGV) == 143
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "train-grpo: stopped by SIGTERM after step 7 of 100; checkpoint saved to "
        "out/checkpoint-7 (--resume auto continues)\n"
    )
