"""Pending reasons (`claims.why.explain`) and the claim-time rules' registry and gate
(`claims.rules`), pure: no database."""

from __future__ import annotations

import itertools
from typing import Any

from scheduler.attempts.shape import JobShape
from scheduler.claims.rules import ClaimGate, Rule, clean_reason, registered, registered_rules
from scheduler.claims.why import MAX_REASON, Fleet, VmView, explain

_ids = itertools.count(1)


def vm(name: str, size: int, free: int, spare: int | None = None, **causes: Any) -> VmView:
    """A VM (ids in creation order) with these GPU counts and causes."""
    return VmView(
        next(_ids),
        name,
        causes.pop("status", "healthy"),
        causes.pop("draining", False),
        size,
        free,
        size if spare is None else spare,
        **causes,
    )


def test_only_vms_whose_kept_out_gpus_would_fit_are_named() -> None:
    """A 2-GPU VM with both unhealthy cannot host a 4-GPU job whatever happens: not named;
    a 4-GPU VM with 2 unhealthy is; a VM whose GPUs jobs hold is not."""
    fleet = [
        vm("small", 2, 0, unhealthy=2, health_reason="lost"),
        vm("a", 4, 2, unhealthy=2, health_reason="Xid 48"),
        vm("busy", 4, 0, spare=0),
    ]
    assert explain([4], Fleet.of(fleet, 4)) == (
        "needs 4 GPUs, largest free block is 2 (a: 2 GPUs unhealthy: Xid 48)"
    )


def test_a_reason_names_three_vms_and_counts_the_rest() -> None:
    """Ten draining VMs: three are named, the seven others counted."""
    fleet = [vm(f"vm{i}", 4, 0, draining=True) for i in range(10)]
    assert explain([4], Fleet.of(fleet, 4)) == (
        "needs 4 GPUs, largest free block is 0 "
        "(vm0: draining; vm1: draining; vm2: draining; 7 more VM(s))"
    )


def test_a_gang_of_unequal_nodes_names_the_vms_for_the_size_it_lacks() -> None:
    """Nodes of 3 and 2 GPUs; one VM has 3 free, another only 1 of its 2 (a leftover holds
    the other): the reason names that VM for the 2-GPU node."""
    fleet = [vm("a", 3, 3), vm("b", 2, 1, leftover=1), vm("c", 8, 0, spare=0)]
    assert explain([3, 2], Fleet.of(fleet, 2)) == (
        "needs 2 VMs with 3 and 2 free GPUs; 1 VM(s) have 2 free, 2 needed "
        "(b: 1 GPU held by a leftover attempt)"
    )


def test_a_reason_is_one_bounded_printable_line_whatever_the_rows_hold() -> None:
    """Names and health texts full of control characters and very long: one line of
    printable characters, at most 500."""
    fleet = [
        vm("x\n" * 100 + f"\x1b{i}", 4, 0, unhealthy=4, health_reason="\t\r\n" + "y" * 5000)
        for i in range(5)
    ]
    reason = explain([4], Fleet.of(fleet, 4))
    assert reason.isprintable() and len(reason) <= MAX_REASON
    assert reason.startswith("needs 4 GPUs, largest free block is 0 (x x x")
    assert clean_reason("a\u2028b\x00c\u200bd") == "a b c d"


class Refuse(Rule):
    name = "refuse\nall"

    def __init__(self, words: str) -> None:
        self.words = words

    def check(self, state: Any, job: Any, shape: JobShape) -> str | None:
        return self.words


class Row:
    def __init__(self, job_id: int) -> None:
        self.id, self.nodes, self.gpus_requested, self.roles = job_id, 1, 1, None


async def test_the_gate_asks_the_registered_rules_and_cleans_their_words() -> None:
    """A rule registered twice counts once and is gone after its block; its words reach
    the reason as one clean line, and empty words name the rule instead."""
    rule, mute = Refuse("too\nmany\x1b GPUs"), Refuse("")
    with registered(rule, rule):
        assert registered_rules() == (rule,)
        gate = await ClaimGate.load(None, [Row(1)])  # type: ignore[arg-type]
        assert gate.refusal(1) == "too many GPUs" and gate.refusal(2) is None
    with registered(mute):
        gate = await ClaimGate.load(None, [Row(1)])  # type: ignore[arg-type]
        assert gate.refusal(1) == "refused by rule refuse all"
    assert registered_rules() == ()
    assert (await ClaimGate.load(None, [Row(1)])).refusal(1) is None  # type: ignore[arg-type]


class Broken(Rule):
    name = "broken"

    def check(self, state: Any, job: Any, shape: JobShape) -> str | None:
        raise KeyError(job.id)


async def test_a_rule_that_raises_refuses_only_that_job_and_says_so() -> None:
    """A rule whose check raises on one row refuses that job with a reason naming the
    rule, instead of failing the whole batch (and its daemon) on it."""
    with registered(Broken()):
        gate = await ClaimGate.load(None, [Row(1)])  # type: ignore[arg-type]
        assert gate.refusal(1) == "rule broken could not check this job (KeyError)"
