"""StopOnSigterm in-process: the handler, the step it stops at, several processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from training.callbacks import StopOnSigterm


@pytest.fixture
def term_restored() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _state(step: int, max_steps: int = 10) -> TrainerState:
    return TrainerState(global_step=step, max_steps=max_steps)


ARGS = TrainingArguments(output_dir="unused", report_to="none")


def test_terms_during_training_stop_at_the_end_of_the_step_with_a_save(term_restored: None):
    stop = StopOnSigterm()
    stop.on_train_begin(ARGS, _state(0), TrainerControl())
    control = TrainerControl()
    stop.on_step_end(ARGS, _state(1), control)
    assert not (control.should_save or control.should_training_stop or stop.stopped)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # A repeat (accelerate's launcher sends its own).
    stop.on_step_end(ARGS, _state(2), control)
    assert control.should_save and control.should_training_stop
    assert stop.stopped and stop.stopped_at_step == 2
    stop.on_train_end(ARGS, _state(2), control)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_term_during_the_last_step_is_a_normal_end(term_restored: None):
    stop = StopOnSigterm()
    stop.on_train_begin(ARGS, _state(9), TrainerControl())
    os.kill(os.getpid(), signal.SIGTERM)
    control = TrainerControl()
    stop.on_step_end(ARGS, _state(10), control)
    assert not stop.stopped and not control.should_training_stop


class _TwoProcesses:
    """What StopOnSigterm uses of accelerate's Accelerator: a flag any process can raise."""

    num_processes = 2

    def __init__(self, other_signalled: bool) -> None:
        self.flag = other_signalled

    def set_trigger(self) -> None:
        self.flag = True

    def check_trigger(self) -> bool:
        raised, self.flag = self.flag, False
        return raised


@pytest.mark.parametrize("other_signalled", [False, True])
def test_with_several_processes_each_stops_when_any_was_signalled(other_signalled: bool):
    stop = StopOnSigterm()
    stop.accelerator = _TwoProcesses(other_signalled)
    control = TrainerControl()
    stop.on_step_end(ARGS, _state(3), control)
    assert stop.stopped == other_signalled == control.should_training_stop
