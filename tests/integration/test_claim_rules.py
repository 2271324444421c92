"""Claim-time rules (`scheduler.claims.rules`) against real Postgres: a toy rule, "no more
than N GPUs per job name prefix", registered once, is honoured by every kind of claim — a
single-node job, a multi-node job, a group on one VM, a group over several VMs — and by the
pending planner, which neither wakes a job the rule refuses nor lets it wait with any words
but the rule's."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from scheduler.attempts.shape import JobShape
from scheduler.claims.batch import CLAIM_COLUMNS, claim_batch
from scheduler.claims.result import Claim, NoClaim
from scheduler.claims.rules import RULE_COLUMNS, Rule, registered
from scheduler.cli.jobfile import group_job_spec
from scheduler.db import Database
from scheduler.gpus import DOUBLE_BOOKED_SQL, PARTIAL_CLAIMS_SQL, release_in_session
from scheduler.jobs import JobSpec, insert_job, transition
from scheduler.jobspec import load_file
from scheduler.models import Job
from scheduler.requeue_steps.wake_pending import wake_pending
from scheduler.states import JobStatus
from tests.workloads.support import add_vm_row

CAP = 4


def prefix(name: str | None) -> str:
    """A job name's prefix: up to its first '-'."""
    return (name or "").split("-", 1)[0]


class PrefixCap(Rule):
    """The toy rule: the jobs whose names share a prefix hold at most `cap` GPUs."""

    name = "prefix-cap"

    def __init__(self, cap: int) -> None:
        self.cap = cap

    async def load(self, conn: AsyncConnection, jobs: Sequence[Any]) -> Counter[str]:
        # One batch at a time counts and takes GPUs under the cap (race-free across
        # dispatchers): the lock is held until the claim's transaction ends.
        await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('rule:prefix-cap'))"))
        held: Counter[str] = Counter()
        rows = await conn.execute(
            text("SELECT j.name, count(*) FROM gpus g JOIN jobs j ON j.id = g.job_id GROUP BY 1")
        )
        for name, n in rows:
            held[prefix(name)] += int(n)
        return held

    def check(self, state: Counter[str], job: Any, shape: JobShape) -> str | None:
        p = prefix(job.name)
        if state[p] + shape.gpus <= self.cap:
            return None
        held, cap, needs = state[p], self.cap, shape.gpus
        return f"jobs named {p}-* may hold {cap} GPUs: they hold {held}, this one needs {needs}"

    def claimed(self, state: Counter[str], job: Any, shape: JobShape) -> None:
        state[prefix(job.name)] += shape.gpus


@pytest.fixture
def prefix_cap() -> Iterator[PrefixCap]:
    """The toy rule, registered once for the test."""
    rule = PrefixCap(CAP)
    with registered(rule):
        yield rule


async def submit(db: Database, spec: JobSpec) -> int:
    """Insert a job as `job submit` does (jobstore.insert_job), unannounced."""
    async with db.transaction() as session:
        return (await insert_job(session, spec, actor="test")).id


def training(name: str, gpus: int, nodes: int = 1) -> JobSpec:
    return JobSpec("tiny", "data.jsonl", ("format",), gpus=gpus, nodes=nodes, name=name)


def group(tmp_path: Path, name: str, trainer: int, server: int, *, own_vm: bool) -> JobSpec:
    """A group from a job file: a trainer and a vLLM server, on one VM or two."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nvllm_server_gpus: {server}\nvllm_server_own_vm: {str(own_vm).lower()}\n"
        f"roles:\n  trainer:\n    gpus: {trainer}\n"
        "    train: {model: tiny, dataset: data.jsonl, reward_functions: [format]}\n"
    )
    return group_job_spec(load_file(str(path)), ())


async def status_of(db: Database, *job_ids: int) -> list[tuple[str, str | None]]:
    async with db.transaction() as session:
        rows = await session.execute(
            select(Job.id, Job.status, Job.status_reason).where(Job.id.in_(job_ids))
        )
        by_id = {r.id: (r.status, r.status_reason) for r in rows}
    return [by_id[j] for j in job_ids]


async def finish(db: Database, job_id: int) -> None:
    """The job ends: its GPUs are given back."""
    async with db.transaction() as session:
        await release_in_session(session, job_id)
        assert await transition(
            session, job_id, expected=JobStatus.STARTING, to=JobStatus.COMPLETED,
            reason="test", actor="test",
        )  # fmt: skip


async def wake(db: Database) -> list[int]:
    """One pass of the pending planner that would wake every pending job it may (no
    recheck delay, pending timeout 0)."""
    async with db.transaction() as session:
        return await wake_pending(
            session, recheck_after_s=0, pending_timeout_s=0, starvation_after_s=3600,
            actor="requeue:test",
        )  # fmt: skip


def words(p: str, held: int, needs: int) -> str:
    return f"jobs named {p}-* may hold {CAP} GPUs: they hold {held}, this one needs {needs}"


async def test_a_rule_registered_once_is_honoured_by_every_kind_of_claim_and_the_planner(
    db: Database, tmp_path: Path, prefix_cap: PrefixCap
) -> None:
    """With "at most 4 GPUs per name prefix" registered once, and room for every job on
    four 8-GPU VMs: in one batch, the first job of each kind takes its GPUs, a second of
    the same prefix and kind is refused and waits pending with the rule's words (a 1-GPU
    single job still fits under the cap); the planner wakes none of the refused even with
    a pending timeout of 0; once the first single job ends, it wakes one of its prefix's
    waiting jobs — the one that fits under the cap — which then claims."""
    for vm in "abcd":
        await add_vm_row(db, vm, 8)
    first = {
        "single": await submit(db, training("sgl-a", 3)),
        "multi-node": await submit(db, training("mn-a", 2, nodes=2)),
        "group on one VM": await submit(db, group(tmp_path, "grp-a", 2, 2, own_vm=False)),
        "group over VMs": await submit(db, group(tmp_path, "spr-a", 2, 2, own_vm=True)),
    }
    small = await submit(db, training("sgl-c", 1))
    second = {
        "single": await submit(db, training("sgl-b", 2)),
        "multi-node": await submit(db, training("mn-b", 1, nodes=2)),
        "group on one VM": await submit(db, group(tmp_path, "grp-b", 1, 1, own_vm=False)),
        "group over VMs": await submit(db, group(tmp_path, "spr-b", 1, 1, own_vm=True)),
    }
    late = await submit(db, training("sgl-d", 2))
    batch = [first["single"], second["single"], small, late]
    batch += [ids[k] for ids in (first, second) for k in ids if k != "single"]
    results = {r.job_id: r for r in await claim_batch(db, batch, actor="test")}

    for kind, job_id in first.items():
        assert isinstance(results[job_id], Claim), kind
    assert isinstance(results[small], Claim)
    held = {"single": 3, "multi-node": 4, "group on one VM": 4, "group over VMs": 4}
    for (kind, job_id), p in zip(second.items(), ("sgl", "mn", "grp", "spr"), strict=True):
        result = results[job_id]
        assert isinstance(result, NoClaim) and result.moved_to_pending, kind
        assert result.reason == words(p, held[kind], 2), kind
        assert await status_of(db, job_id) == [("pending", words(p, held[kind], 2))], kind
    async with db.transaction() as session:
        assert await session.scalar(PARTIAL_CLAIMS_SQL) == 0
        assert await session.scalar(DOUBLE_BOOKED_SQL) == 0

    assert await wake(db) == []
    await finish(db, first["single"])
    assert await wake(db) == [second["single"]]
    assert results[late].reason == words("sgl", 4, 2)
    assert await status_of(db, late) == [("pending", words("sgl", 3, 2))]
    for kind in ("multi-node", "group on one VM", "group over VMs"):
        assert (await status_of(db, second[kind]))[0][0] == "pending", kind
    (claimed,) = await claim_batch(db, [second["single"]], actor="test")
    assert isinstance(claimed, Claim)


async def test_a_rule_holds_only_while_registered(db: Database) -> None:
    """The same refused job claims once the rule is unregistered: the registry alone
    decides which rules hold."""
    await add_vm_row(db, "a", 8)
    taken = await submit(db, training("x-a", 4))
    refused = await submit(db, training("x-b", 1))
    with registered(PrefixCap(CAP)):
        assert isinstance((await claim_batch(db, [taken], actor="test"))[0], Claim)
        (result,) = await claim_batch(db, [refused], actor="test")
        assert isinstance(result, NoClaim) and result.reason == words("x", 4, 1)
    assert await wake(db) == [refused]
    assert isinstance((await claim_batch(db, [refused], actor="test"))[0], Claim)


def test_the_claim_reads_every_column_a_rule_may_read() -> None:
    """`RULE_COLUMNS` ⊆ `CLAIM_COLUMNS`: a rule sees the same row in a claim as in the
    planner."""
    assert {c.key for c in RULE_COLUMNS} <= {c.key for c in CLAIM_COLUMNS}


async def test_racing_dispatchers_never_let_a_rule_be_passed(db: Database) -> None:
    """Six claimers racing over 24 one-GPU jobs of one prefix, with room for all: the rule,
    loaded inside each claim's transaction under its lock, lets exactly 4 GPUs be taken."""
    for vm in "ab":
        await add_vm_row(db, vm, 16)
    ids = [await submit(db, training(f"race-{i}", 1)) for i in range(24)]
    with registered(PrefixCap(CAP)):
        outcomes = await asyncio.gather(
            *(claim_batch(db, ids[k : k + 4], actor=f"d{k}") for k in range(0, 24, 4))
        )
    claims = [r for batch in outcomes for r in batch if isinstance(r, Claim)]
    assert len(claims) == CAP
    async with db.transaction() as session:
        held = await session.scalar(text("SELECT count(*) FROM gpus WHERE job_id IS NOT NULL"))
        pending = await session.scalar(text("SELECT count(*) FROM jobs WHERE status = 'pending'"))
    assert (held, pending) == (CAP, 24 - CAP)
