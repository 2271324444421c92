"""A GPU's health is judged once per poll (`gpu_poller.state.judge`, when the inventory
collects what the poll saw), and the fault check of live attempts (`gpu_faults`) acts on
that verdict instead of judging the same reading again."""

from __future__ import annotations

from scheduler.gpu_health import FAULT, Condition, Health, Step
from scheduler.gpu_poller import inventory
from scheduler.gpu_poller.gpu_faults import broken_gpus
from scheduler.gpu_poller.state import GpuRow, Outcome, SweepStats, VMState, judge
from scheduler.nvidia_smi import GpuInfo
from scheduler.poll import PollResult
from scheduler.transport_types import VMTarget
from scheduler.verdicts import LiveJob

UUID = "GPU-11111111-2222-3333-4444-555555555555"
GONE = "GPU-99999999-2222-3333-4444-555555555555"


def vm_running_job_7() -> VMState:
    vm = VMState(VMTarget(1, "a", "127.0.0.1"), "healthy", 0)
    values = (0, "H100", 80000, 100, 0, True, False)
    vm.gpus = {UUID: GpuRow(UUID, 7, values), GONE: GpuRow(GONE, None, (1, *values[1:]))}
    vm.jobs = [LiveJob(7, 1, "running", 1, 42)]
    return vm


def reading(fault: str | None = None) -> PollResult:
    return PollResult(gpus=(GpuInfo(0, UUID, "H100", 80000, 100, 0, 0, fault=fault),))


def test_the_inventory_judges_each_gpu_once_and_leaves_the_verdict_on_the_outcome() -> None:
    """The GPU nvidia-smi lists as requiring a reset and the one it no longer lists are
    judged when the poll is collected; the verdicts stay on the outcome."""
    vm = vm_running_job_7()
    outcome = Outcome(vm, result=reading("[GPU requires reset]"))
    inventory._collect(outcome, reading("[GPU requires reset]"), inventory._Writes(), SweepStats())
    assert outcome.health is not None
    assert outcome.health == judge(vm, reading("[GPU requires reset]"))
    assert outcome.health[UUID].condition is not None
    assert outcome.health[UUID].condition.kind == FAULT
    assert outcome.health[GONE].health.reason == "lost: no longer listed by nvidia-smi"


def test_the_fault_check_acts_on_the_verdict_it_is_handed() -> None:
    """A verdict of a fault on the job's GPU stops it, whatever the reading would say if
    judged again; with no verdict (the poll was not judged) nothing is stopped."""
    vm = vm_running_job_7()
    fault = Condition(FAULT, "requires reset: nvidia-smi prints [GPU requires reset]")
    judged = {UUID: Step(Health(fault.reason), fault)}
    broken = broken_gpus(Outcome(vm, result=reading(), health=judged))
    assert [(b.job_id, b.uuid, b.reason) for b in broken] == [(7, UUID, fault.reason)]
    assert broken_gpus(Outcome(vm, result=reading("[GPU requires reset]"))) == []
    clean = judge(vm, reading())
    assert broken_gpus(Outcome(vm, result=reading(), health=clean)) == []
