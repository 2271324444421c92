"""A job's environment is clean and documented on every transport (docs/invariants.md, invariant
7): none of
the scheduler's variables reach it, only PATH, HOME, USER, LANG…, its RLFLEET_* job
variables, CUDA_VISIBLE_DEVICES, the VM's ~/.rlfleet/env and its own `--env` values."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats as nats_client
import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.jobs import get_job, job_to_dict
from scheduler.remote.env import PASSED_ENV
from scheduler.validate import SCHEDULER_ENV
from tests.fleet import SimFleet
from tests.workloads.support import add_vm_row, mark_polled, new_job, publish, running_dispatcher

# Every test here takes seconds (measured: CONTRIBUTING.md, "Test lanes").
pytestmark = pytest.mark.slow

DUMP_ENV = """
import json, os, sys
path = os.path.join(os.environ["HOME"], "env-" + os.environ["RLFLEET_JOB_ID"] + ".json")
with open(path + ".tmp", "w") as f:
    json.dump(dict(os.environ), f)
os.replace(path + ".tmp", path)
"""
SCHEDULER_SECRETS = {
    "RLFLEET_NATS_TOKEN": "nats-token-9f8e7d",
    "RLFLEET_NATS_PASSWORD": "nats-password-6c5b4a",
    "RLFLEET_SCHEDULER_MARKER": "marker-3d2c1b",
    "SCHEDULER_ONLY_MARKER": "marker-a1b2c3",
}
JOB_ENV = (("WANDB_API_KEY", "wandb-job-key"), ("SPACED", "a b $HOME `id` 'q' \"d\""))
VM_ENV = {"HF_TOKEN": "hf-vm-token", "HTTPS_PROXY": "http://proxy.example:3128"}
SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}
JOB_VARIABLES = set(SCHEDULER_ENV)
"""What the scheduler sets for every job (the GPUs, by UUID and in PCI bus order, the job's
id, attempt and progress file)."""


async def wait_json(path: Path, timeout: float = 60) -> dict[str, str]:
    """The JSON file once it exists."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not path.exists():
        assert asyncio.get_running_loop().time() < deadline, f"no {path}"
        await asyncio.sleep(0.2)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


async def test_jobs_on_a_local_and_an_ssh_vm_see_a_clean_environment_and_their_env(
    sim_fleet: Callable[..., Awaitable[SimFleet]],
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a dispatcher whose environment holds the scheduler's secrets
    password_url = db.url.replace("postgres@", "postgres:db-password-0e0f@")
    monkeypatch.setenv("RLFLEET_DATABASE_URL", password_url)
    for key, value in SCHEDULER_SECRETS.items():
        monkeypatch.setenv(key, value)
    local_home = tmp_path / "local-home"
    (local_home / ".rlfleet").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(local_home))
    dump = tmp_path / "dump_env.py"
    dump.write_text(DUMP_ENV)
    # And an SSH VM and a local VM, each with a ~/.rlfleet/env
    fleet = await sim_fleet(1)
    ssh_vm = fleet[0]
    ssh_id = (await fleet.register(db, entrypoint=str(dump), python=sys.executable))[ssh_vm.name]
    await mark_polled(db, {ssh_id: 1})
    ssh_vm.write_vm_env(VM_ENV)
    (local_home / ".rlfleet" / "env").write_text(
        "# the operator's settings\n" + "".join(f'export {k}="{v}"\n' for k, v in VM_ENV.items())
    )
    await add_vm_row(
        db, "local", 1, transport="local", python=sys.executable,
        entrypoint=str(dump),
    )  # fmt: skip
    # When two jobs with `--env` values run, one on each VM
    job_ids = [await new_job(db, 1, env=JOB_ENV) for _ in range(2)]
    nc = await nats_client.connect(nats.url)
    try:
        async with running_dispatcher(db, nats.url):
            await publish(nc, *job_ids)
            dumps = {}
            for job_id in job_ids:
                async with db.transaction() as session:
                    job = await get_job(session, job_id)
                    while job.vm_id is None:
                        await asyncio.sleep(0.2)
                        await session.refresh(job)
                    home = ssh_vm.home if job.vm_id == ssh_id else local_home
                dumps[home] = await wait_json(home / f"env-{job_id}.json")
    finally:
        await nc.close()
    # Then each job, on either transport, saw its own and the VM's variables
    assert set(dumps) == {ssh_vm.home, local_home}
    for home, env in dumps.items():
        for key, value in [*JOB_ENV, *VM_ENV.items()]:
            assert env.get(key) == value, (home, key)
        # And none of the scheduler's: only the documented names are there at all
        allowed = (
            set(PASSED_ENV) | JOB_VARIABLES | SHELL_OWN | set(VM_ENV) | {k for k, _ in JOB_ENV}
        )
        assert set(env) <= allowed, (home, set(env) - allowed)
        text = json.dumps(env)
        for secret in [*SCHEDULER_SECRETS.values(), "db-password-0e0f", "RLFLEET_DATABASE_URL"]:
            assert secret not in text, (home, secret)
        assert env["HOME"] == str(home)
    # And the values sit in a private file of the attempt, on no command line
    for home in dumps:
        attempt_dirs = list(home.glob(".rlfleet/*/jobs/*/1-*"))
        assert attempt_dirs
        for attempt in attempt_dirs:
            assert (attempt / "job.env").stat().st_mode & 0o777 == 0o600
            assert "wandb-job-key" not in (attempt / "launch.sh").read_text()
    # And listings show the names only
    async with db.transaction() as session:
        shown = job_to_dict(await get_job(session, job_ids[0], with_events=True), events=True)
    assert shown["env_keys"] == ["SPACED", "WANDB_API_KEY"]
    assert "wandb-job-key" not in json.dumps(shown, default=str)
