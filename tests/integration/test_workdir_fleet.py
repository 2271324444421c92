"""A job's workdir on the SSH test fleet, through the real dispatcher, poller and requeue
manager: a workdir with a reward module and a dataset runs on a VM that had neither
(`--reward-function my_rewards:length --dataset data/train.jsonl`, relative), in its own
copy, first on PYTHONPATH; a second job with the same workdir is not sent again; a retry
on another VM gets it there. Only the GPU is simulated."""

from __future__ import annotations

import asyncio
import hashlib
import json
import stat
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from scheduler.db import Database
from scheduler.dispatcher.launch import Launcher
from scheduler.embedded import EmbeddedNats
from scheduler.fleet import set_draining
from scheduler.gpu_poller import GpuPoller
from scheduler.jobspec import parse_data
from scheduler.models import Job, JobEvent, Workdir
from scheduler.remote.workdir import RECEIVE_CODE
from scheduler.requeue import RequeueConfig
from scheduler.retry import RetryPolicy
from scheduler.transport import CommandResult, Transport, VMTarget, make_transport
from scheduler.workdir import PackedWorkdir, pack
from tests.fleet import SimFleet
from tests.workloads.support import (
    installation,
    job_row,
    new_job,
    scheduling,
    write_fake_python,
)

pytestmark = pytest.mark.slow

WORKDIR_TRAIN = Path(__file__).resolve().parents[1] / "workloads" / "workdir_train.py"
CONFIG = RequeueConfig(
    interval_s=0.1,
    pending_timeout_s=3600,
    node_lost_timeout_s=5,
    republish_after_s=3600,
    recheck_after_s=0,
    starvation_after_s=3600,
    policy=RetryPolicy(base_delay_s=0.2, factor=2, max_delay_s=10, jitter=0.0),
)
ROWS = [("2+2=", "4"), ("3+3=", "six"), ("1+1=", "22")]


class Counting:
    """The test's SSH transport, counting the workdirs each VM was sent (by name)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.sent: Counter[str] = Counter()

    async def run(
        self,
        target: VMTarget,
        command: str,
        *,
        timeout: float,
        input: str | None = None,
        persistent: bool = False,
        max_output: int | None = None,
    ) -> CommandResult:
        if RECEIVE_CODE.strip().splitlines()[0] in command and input is not None:
            self.sent[target.name] += 1
        return await self.inner.run(
            target, command, timeout=timeout, input=input, persistent=persistent,
            max_output=max_output,
        )  # fmt: skip

    async def close(self) -> None:
        await self.inner.close()


def make_workdir(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "my_rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    (root / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in ROWS)
    )
    (root / "prepare.sh").write_text("#!/bin/sh\n")
    (root / "prepare.sh").chmod(0o750)
    (root / "secret.txt").write_text("not for the VMs\n")
    (root / ".rlfleetignore").write_text("secret.txt\n")
    return root


async def drain_only(db: Database, fleet: SimFleet, usable: int) -> None:
    """Every VM of the fleet drained but `fleet[usable]`."""
    async with db.transaction() as session:
        for index, vm in enumerate(fleet):
            await set_draining(session, vm.name, index != usable)


async def schedule_until(
    db: Database,
    nats_url: str,
    transport: Any,
    poller: GpuPoller,
    job_id: int,
    done: Callable[[Job], bool],
    timeout_s: float = 120,
) -> Job:
    deadline = time.monotonic() + timeout_s
    async with scheduling(db, nats_url, transport, CONFIG) as requeue:
        while not done(job := await job_row(db, job_id)):
            assert time.monotonic() < deadline, f"job {job_id}: {job.status} {job.status_reason}"
            await poller.sweep()
            await requeue.tick()
            await asyncio.sleep(0.2)
    return job


async def test_a_workdir_reaches_each_vm_once_and_every_attempt_runs_in_its_own_copy(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
) -> None:
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(WORKDIR_TRAIN), python=sys.executable)
    transport = Counting(make_transport(connect_timeout=2.0, login_timeout=2.0))
    try:
        poller = GpuPoller(db, transport, unreachable_after=1)  # type: ignore[arg-type]
        await poller.sweep()
        source = make_workdir(tmp_path / "project")
        packed = pack(source)
        inst = await installation(db)
        expected = [float(len(c)) for _p, c in ROWS]

        def submit(out: Path, *extra: str, retries: int = 0) -> Awaitable[int]:
            return new_job(
                db, 1, extra, dataset="data/train.jsonl", reward_functions=("my_rewards:length",),
                workdir=pack(source), max_retries=retries, output_dir=str(out),
            )  # fmt: skip

        # 1. vm0 has neither the code nor the data: it is sent the workdir and runs in it.
        await drain_only(db, fleet, 0)
        first = await submit(tmp_path / "out1")
        job = await schedule_until(db, nats.url, transport, poller, first,
                                   lambda j: j.status in ("completed", "failed"))  # fmt: skip
        log = Path(job.attempt_dir or "", "train.log")
        assert job.status == "completed", (job.status_reason, log.read_text()[-2000:])
        result = json.loads((tmp_path / "out1" / "result-1-0.json").read_text())
        assert result["scores"] == expected and result["on_path"] is True
        work = Path(job.attempt_dir or "") / "work"
        assert Path(result["cwd"]).resolve() == work.resolve()
        assert result["pythonpath"].split(":")[0] == result["workdir"] == str(work)
        cache = fleet[0].home / ".rlfleet" / inst / "workdirs" / packed.digest
        assert sorted(p.name for p in cache.iterdir()) == sorted(
            [".rlfleetignore", "data", "my_rewards.py", "prepare.sh"]
        )
        assert stat.S_IMODE((work / "prepare.sh").stat().st_mode) == 0o750  # modes kept
        assert (work / "scratch.txt").is_file()  # the attempt's copy, not the cache
        assert not (work / "secret.txt").exists()
        assert transport.sent == Counter({fleet[0].name: 1})

        # 2. The same workdir again (packed anew: the same digest): stored once, not sent.
        second = await submit(tmp_path / "out2")
        job = await schedule_until(db, nats.url, transport, poller, second,
                                   lambda j: j.status in ("completed", "failed"))  # fmt: skip
        assert job.status == "completed", job.status_reason
        assert json.loads((tmp_path / "out2" / "result-1-0.json").read_text())["scores"] == expected
        assert transport.sent == Counter({fleet[0].name: 1})
        assert not (cache / "scratch.txt").exists()
        async with db.transaction() as session:
            assert await session.scalar(select(func.count()).select_from(Workdir)) == 1

        # 3. A retry on another VM, which never had the workdir, gets it there.
        third = await submit(tmp_path / "out3", "--fail_first", retries=1)
        job = await schedule_until(db, nats.url, transport, poller, third,
                                   lambda j: j.status == "failed")  # fmt: skip
        first_try = json.loads((tmp_path / "out3" / "result-1-0.json").read_text())
        assert job.attempt == 1 and first_try["scores"] == expected
        await drain_only(db, fleet, 1)
        job = await schedule_until(db, nats.url, transport, poller, third,
                                   lambda j: j.status == "completed")  # fmt: skip
        assert job.attempt == 2
        result = json.loads((tmp_path / "out3" / "result-2-0.json").read_text())
        assert result["scores"] == expected and result["on_path"] is True
        assert str(fleet[1].home) in result["cwd"]
        assert transport.sent == Counter({fleet[0].name: 1, fleet[1].name: 1})
    finally:
        await transport.close()


async def test_a_stored_workdir_that_is_not_its_digest_fails_its_job_only(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
) -> None:
    """A `workdirs` row whose bytes are not its digest (written by hand, or damaged) fails
    its job at launch and is never sent; the dispatcher goes on, and the next job with a
    sound workdir runs."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(WORKDIR_TRAIN), python=sys.executable)
    transport = Counting(make_transport(connect_timeout=2.0, login_timeout=2.0))
    try:
        poller = GpuPoller(db, transport, unreachable_after=1)  # type: ignore[arg-type]
        await poller.sweep()
        good = pack(make_workdir(tmp_path / "project"))
        # Sound bytes under another digest: every column check passes.
        damaged = PackedWorkdir(
            hashlib.sha256(b"something else").hexdigest(), good.data, good.files, 1
        )
        spec = {"dataset": "data/train.jsonl", "reward_functions": ("my_rewards:length",)}
        bad_job = await new_job(db, 1, workdir=damaged, max_retries=0, **spec)
        job = await schedule_until(db, nats.url, transport, poller, bad_job,
                                   lambda j: j.status == "failed")  # fmt: skip
        async with db.transaction() as session:
            reasons = (
                await session.scalars(select(JobEvent.reason).where(JobEvent.job_id == bad_job))
            ).all()
        # The failure's own reason (the requeue manager's verdict may come after it).
        assert any("the stored bytes do not match their digest" in (r or "") for r in reasons)
        assert transport.sent == Counter()
        assert not (fleet[0].home / ".rlfleet" / await installation(db) / "workdirs").exists()
        ok_job = await new_job(db, 1, workdir=good, output_dir=str(tmp_path / "out"), **spec)
        job = await schedule_until(db, nats.url, transport, poller, ok_job,
                                   lambda j: j.status in ("completed", "failed"))  # fmt: skip
        assert job.status == "completed", job.status_reason
    finally:
        await transport.close()


async def test_a_group_role_runs_in_the_attempts_copy_of_the_workdir(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    transport: Transport,
    tmp_path: Path,
) -> None:
    """A job group's role started by a command relative to the workdir (`python role.py`)
    runs there, in the attempt's copy, with the copy first on PYTHONPATH."""
    fleet = await sim_fleet(1, gpus_per_vm=1)
    await fleet.register(db)
    poller = GpuPoller(db, transport, unreachable_after=1)
    await poller.sweep()
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("VALUE = 'from the workdir'\n")
    (project / "role.py").write_text(
        "import json, os, helper\n"
        "print('role: ' + json.dumps({'cwd': os.getcwd(), 'value': helper.VALUE,\n"
        "      'path': os.environ['PYTHONPATH'].split(':')[0]}), flush=True)\n"
    )
    roles = parse_data(
        {"roles": {"main": {"command": [sys.executable, "role.py"], "gpus": 1}}}
    ).to_data()
    job_id = await new_job(
        db, 1, roles=roles, model="-", dataset="-", reward_functions=("-",),
        max_retries=0, workdir=pack(project),
    )  # fmt: skip
    job = await schedule_until(db, nats.url, transport, poller, job_id,
                               lambda j: j.status in ("completed", "failed"))  # fmt: skip
    folder = Path(job.attempt_dir or "")
    assert job.status == "completed", (job.status_reason, (folder / "train.log").read_text())
    log = (folder / "main.log").read_text()
    seen = json.loads(next(x for x in log.splitlines() if x.startswith("role: "))[6:])
    assert seen == {"cwd": str(folder / "work"), "value": "from the workdir",
                    "path": str(folder / "work")}  # fmt: skip


async def test_every_rank_of_a_multi_node_job_gets_the_workdir(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 2 × 1 job: each VM is sent the workdir once, read from the database once for
    both, and each rank runs in its own copy."""
    reads: list[str] = []
    read = Launcher._workdir_bytes

    async def counted(self: Launcher, digest: str) -> bytes | str:
        reads.append(digest)
        return await read(self, digest)

    monkeypatch.setattr(Launcher, "_workdir_bytes", counted)
    fleet = await sim_fleet(2, gpus_per_vm=1)
    await fleet.register(db, entrypoint=str(WORKDIR_TRAIN), python=write_fake_python(tmp_path))
    transport = Counting(make_transport(connect_timeout=2.0, login_timeout=2.0))
    try:
        poller = GpuPoller(db, transport, unreachable_after=1)  # type: ignore[arg-type]
        await poller.sweep()
        out = tmp_path / "out"
        job_id = await new_job(
            db, 1, dataset="data/train.jsonl", reward_functions=("my_rewards:length",),
            workdir=pack(make_workdir(tmp_path / "project")), max_retries=0,
            output_dir=str(out), nodes=2,
        )  # fmt: skip
        job = await schedule_until(db, nats.url, transport, poller, job_id,
                                   lambda j: j.status in ("completed", "failed"))  # fmt: skip
        assert job.status == "completed", job.status_reason
        results = [json.loads((out / f"result-1-{rank}.json").read_text()) for rank in (0, 1)]
        assert all(r["scores"] == [float(len(c)) for _p, c in ROWS] for r in results)
        assert all(r["on_path"] and r["cwd"].endswith("/work") for r in results)
        homes = [str(vm.home) for vm in fleet]
        assert sorted(h for r in results for h in homes if r["cwd"].startswith(h)) == sorted(homes)
        assert transport.sent == Counter({vm.name: 1 for vm in fleet})
        assert len(reads) == 1
    finally:
        await transport.close()
