"""Structure figure: the scheduler modules a job id crosses from `job submit` to completion.

One job at a time runs for real, in this process: embedded Postgres and nats-server, a
simulated VM (a real SSH server on loopback, simulated GPUs: tests/fleet.py), the real
`submit_job`, dispatcher, poller and requeue manager. A profile hook notes every call of a
function of `scheduler` whose arguments carry the job's id — the id itself (`job_id`,
`job`, `id`, …) or an object holding it (a claim, a live job, a row: `.job_id` or `.id`) —
and the module that function lives in. The trail, in call order, gives:

- `modules`: how many modules see the id between submit and the job's last move;
- `returns`: the steps by which the trail comes back to a module it had already left
  (each counted once, however often the poller's sweeps repeat it);
- `trail`: the modules, in first-seen order (`--trail` prints the whole trail).

Three shapes are followed: a one-GPU job, a job over two VMs (`nodes=2`) and a job group
whose two roles run on two VMs.

    .venv/bin/python bench/job_path.py [--trail]

A figure of structure, not of speed: the same job on the same code gives the same trail
(up to the order of concurrent steps), so before/after is one run on each commit.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.db import Database  # noqa: E402
from scheduler.embedded import EmbeddedNats, EmbeddedPostgres  # noqa: E402
from scheduler.gpu_poller import GpuPoller  # noqa: E402
from scheduler.jobstore import JobSpec  # noqa: E402
from scheduler.logging import configure  # noqa: E402
from scheduler.migrate import upgrade  # noqa: E402
from scheduler.requeue import RequeueConfig  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from scheduler.submit import submit_job  # noqa: E402
from scheduler.transport import make_transport  # noqa: E402
from tests.fleet import FAKE_TRAIN, start_fleet  # noqa: E402
from tests.workloads.support import job_row, scheduling, write_fake_python  # noqa: E402

ID_NAMES = ("job_id", "job", "id", "jid")
CARRIERS = ("claim", "job", "row", "record", "verdict", "live", "item", "launch")


class Trail:
    """The scheduler modules whose functions were called with job `job_id`, in order."""

    def __init__(self) -> None:
        self.job_id: int | None = None
        self.modules: list[str] = []

    def _carries(self, frame: FrameType) -> bool:
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        local = frame.f_locals
        for name in names:
            value = local.get(name)
            if value is self.job_id and name in ID_NAMES:
                return True
            if type(value) is int and value == self.job_id and name in ID_NAMES:
                return True
            if name in CARRIERS or name == "self":
                inner = getattr(value, "job_id", None)
                if isinstance(inner, int) and inner == self.job_id:
                    return True
                inner = getattr(getattr(value, "job", None), "id", None)
                if isinstance(inner, int) and inner == self.job_id:
                    return True
                if name != "self":
                    inner = getattr(value, "id", None)
                    if isinstance(inner, int) and inner == self.job_id:
                        return True
            if isinstance(value, (list, tuple)) and name.endswith("ids") and self.job_id in value:
                return True
        return False

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or self.job_id is None:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("scheduler.") or module.startswith("scheduler.logging"):
            return
        try:
            seen = self._carries(frame)
        except Exception:  # noqa: BLE001 - a property that raises is not the id
            return
        if seen and (not self.modules or self.modules[-1] != module):
            self.modules.append(module)

    def figures(self) -> tuple[int, int, list[str]]:
        """(distinct modules, distinct returns, modules in first-seen order). A return is
        a step A → B of the trail to a module B already left before: each such step is
        counted once, however often the poller's sweeps repeat it."""
        first: list[str] = []
        returns: set[tuple[str, str]] = set()
        previous = ""
        for module in self.modules:
            if module in first:
                returns.add((previous, module))
            else:
                first.append(module)
            previous = module
        return len(first), len(returns), first


GROUP_ROLES = {
    "roles": {
        "trainer": {"gpus": 1, "primary": True, "command": ["sh", "-c", "sleep 1"]},
        "server": {"gpus": 1, "own_vm": True, "command": ["sh", "-c", "sleep 30"]},
    }
}


async def follow(
    db: Database, settings: Settings, nats_url: str, spec: JobSpec, trail: Trail
) -> str:
    """Submit `spec` with the hook on, schedule until it ends; its final status."""
    transport = make_transport(connect_timeout=5.0, login_timeout=5.0)
    poller = GpuPoller(db, transport)
    config = RequeueConfig(interval_s=0.2, recheck_after_s=0.3)
    trail.job_id = None
    sys.setprofile(trail.hook)
    try:
        submitted = await submit_job(db, settings, spec, actor="bench")
        trail.job_id = submitted.job_id
        # The submit itself ran before the id was known: note its module first.
        trail.modules.insert(0, "scheduler.submit")
        deadline = time.monotonic() + 120
        async with scheduling(db, nats_url, transport, config) as requeue:
            while (job := await job_row(db, submitted.job_id)).status not in (
                "completed",
                "failed",
            ):
                if time.monotonic() > deadline:
                    raise SystemExit(f"job {submitted.job_id} is still {job.status}")
                await poller.sweep()
                await requeue.tick()
                await asyncio.sleep(0.2)
    finally:
        sys.setprofile(None)
        await transport.close()
    return job.status


async def run(show_trail: bool) -> None:
    configure("WARNING")
    with tempfile.TemporaryDirectory(prefix="rlfleet-path-") as tmp:
        root = Path(tmp)
        pg = EmbeddedPostgres(root / "pg", durable=False)
        pg.start()
        nats = EmbeddedNats(root / "nats")
        nats.start()
        try:
            url = pg.create_database("path")
            upgrade(url)
            db = Database(url)
            fleet = await start_fleet(root / "fleet", 2, gpus_per_vm=2)
            await fleet.register(db, entrypoint=str(FAKE_TRAIN), python=write_fake_python(root))
            await GpuPoller(db, make_transport()).sweep()
            settings = Settings(database_url=url, nats_url=nats.url)
            train = {
                "model": "tiny",
                "dataset": "data.jsonl",
                "reward_functions": ("format",),
                "extra_args": ("--fake_seconds", "0.5"),
            }
            cases: list[tuple[str, Callable[[], JobSpec]]] = [
                ("one GPU", lambda: JobSpec(**train)),  # type: ignore[arg-type]
                ("two VMs", lambda: JobSpec(nodes=2, **train)),  # type: ignore[arg-type]
                ("group", lambda: _group_spec(train)),
            ]
            for name, make in cases:
                trail = Trail()
                status = await follow(db, settings, nats.url, make(), trail)
                count, returns, first = trail.figures()
                print(f"job_path: case={name!r} status={status} modules={count} returns={returns}")
                print("  " + " ".join(m.removeprefix("scheduler.") for m in first))
                if show_trail:
                    print(
                        "  trail: "
                        + " > ".join(m.removeprefix("scheduler.") for m in trail.modules)
                    )
            await fleet.close()
            await db.dispose()
        finally:
            nats.stop()
            pg.stop()


def _group_spec(train: dict[str, Any]) -> JobSpec:
    """The two-role group of GROUP_ROLES as `job submit -f` would insert it."""
    from scheduler.cli.jobfile import group_job_spec
    from scheduler.jobspec import parse_data

    return group_job_spec(parse_data(GROUP_ROLES), ())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trail", action="store_true", help="print every step of each trail")
    asyncio.run(run(parser.parse_args().trail))


if __name__ == "__main__":
    main()
