"""Which history samples the poller writes (scheduler.gpu_poller.sweep.HistoryGate)."""

from __future__ import annotations

import time

from scheduler.gpu_poller.sweep import HistoryGate
from scheduler.history import GpuReading, ProgressRow


def reading(vm_id: int) -> GpuReading:
    return GpuReading(vm_id, f"GPU-{vm_id}", 50, 1000, 80000)


def test_a_step_already_written_is_not_written_again() -> None:
    gate = HistoryGate()
    first = [ProgressRow(1, 1, 5, 0.5, 1.0), ProgressRow(2, 1, 3, None, None)]
    progress, _ = gate.keep(first, [])
    assert progress == first
    gate.written(progress, [])
    # The same steps again (the attempts did not advance), and one that advanced
    again = [ProgressRow(1, 1, 5, 0.5, 1.0), ProgressRow(2, 1, 4, None, None)]
    progress, _ = gate.keep(again, [])
    assert progress == [ProgressRow(2, 1, 4, None, None)]
    # A new attempt of job 1 at the same step is new
    assert gate.keep([ProgressRow(1, 2, 5, 0.5, 1.0)], [])[0] == [ProgressRow(1, 2, 5, 0.5, 1.0)]


def test_a_batch_that_never_committed_is_written_again() -> None:
    gate = HistoryGate(gpu_every_s=60)
    rows = [ProgressRow(1, 1, 5, 0.5, 1.0)]
    assert gate.keep(rows, [reading(1)]) == (rows, [reading(1)])
    # (its transaction failed: `written` was never called)
    assert gate.keep(rows, [reading(1)]) == (rows, [reading(1)])


def test_gpu_samples_of_a_vm_at_most_every_interval() -> None:
    gate = HistoryGate(gpu_every_s=0.2)
    _, samples = gate.keep([], [reading(1), reading(2)])
    gate.written([], samples)
    assert len(samples) == 2
    # Polled again at once: not due; a VM never sampled is
    _, samples = gate.keep([], [reading(1), reading(3)])
    assert samples == [reading(3)]
    gate.written([], samples)
    deadline = time.monotonic() + 5
    while not gate.keep([], [reading(1)])[1]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Every poll, without an interval
    every = HistoryGate()
    for _ in range(3):
        _, samples = every.keep([], [reading(1)])
        every.written([], samples)
        assert samples == [reading(1)]
