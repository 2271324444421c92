"""The scheduler's own code on a VM never imports a job's (issue 29, point 3;
docs/security.md, "A job's workdir"): a job whose `--workdir` ships `training/`,
`scheduler/` (a fake store agent that says the final outputs are in the store already),
`rewards/`, `json.py` and `site.py`, each of which notes in a file which process imported
it, runs on the SSH test fleet and behind OpenSSH's sshd with the real poller, dispatcher,
requeue manager, a `file://` store and a job group. The wrapper's check, the store agent
(restore, watch, finish) and the group supervisor import none of them; only the job's own
processes (its training, its roles) do. The VM is never marked, a job whose own
`training/` is broken fails counted (never a machine fault), and a job completes by
training, never by a fake agent."""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from scheduler.db import Database
from scheduler.embedded import EmbeddedNats
from scheduler.jobspec import parse_data
from scheduler.poll import CHECK_RC, check_command
from scheduler.remote.isolated import module_words
from scheduler.remote.launch import entry_check_words
from scheduler.workdir import pack
from tests.fleet import SimFleet
from tests.integration.test_hostile_jobs import CONFIG, VMWatch, wait_vm_healthy
from tests.sshd import SshdFleet, sshd_fleet  # noqa: F401 - the fixture
from tests.workloads.support import daemons, installation, job_row, new_job

FleetFactory = Callable[..., Awaitable[SimFleet]]
ENTRYPOINT = "training.train_grpo"
"""The VMs' entrypoint: a module of the installed `training` package, which each job's
workdir here ships a fake of."""
OWN = ("--model", "job-role")
"""A word only the job's own processes have on their command line: the training's
`--model`, the role's `job-role`."""

MARK = """\
import sys as _s
with open({log!r}, "a") as _f:
    _f.write({name!r} + " " + repr(list(getattr(_s, "orig_argv", _s.argv))) + "\\n")
"""

FAKE_AGENT = """\
import sys
# The real agent's FINAL_FOUND_EXIT: the job would complete without training.
sys.exit(3 if "restore" in sys.argv else 0)
"""

FAKE_TRAINER = """\
import os, sys
out = sys.argv[sys.argv.index("--output_dir") + 1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "trained.txt"), "w") as f:
    f.write("by the job's own trainer\\n")
print("fake job trainer ran", flush=True)
"""


def hostile_workdir(root: Path, log: Path, *, broken_training: bool = False) -> Path:
    """A workdir whose every module notes its importer in `log`: a fake `training`
    package (whose `__init__` raises when `broken_training`), a fake `scheduler` with a
    store agent that says "final outputs found", `rewards/`, `json.py` and `site.py`."""
    files = {
        "training/__init__.py": "",
        "training/train_grpo.py": FAKE_TRAINER,
        "scheduler/__init__.py": "",
        "scheduler/store/__init__.py": "",
        "scheduler/store/agent.py": FAKE_AGENT,
        "rewards/__init__.py": "",
        "json.py": "",
        "site.py": "",
    }
    if broken_training:
        files["training/__init__.py"] = 'raise ImportError("the job\'s own training is broken")\n'
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        path.write_text(MARK.format(log=str(log), name=name) + body)
    return root


def importers(log: Path) -> list[tuple[str, list[str]]]:
    """(module, argv of the process that imported it) for each line of `log`."""
    if not log.exists():
        return []
    seen = []
    for line in log.read_text().splitlines():
        name, _, argv = line.partition(" ")
        seen.append((name, eval(argv)))  # noqa: S307 - written by repr() above
    return seen


def helpers_among(seen: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The imports made by a process that is not the job's own (a scheduler helper)."""
    return [(name, argv) for name, argv in seen if not any(w in argv for w in OWN)]


async def isolation_proof(fleet: Any, db: Database, nats: EmbeddedNats, tmp_path: Path) -> None:
    """Three jobs on one 3-GPU VM of `fleet` (entrypoint `training.train_grpo`, the
    test's python): a job whose workdir's `training` raises on import (one retry), one
    with a store whose workdir ships a fake store agent, and a job group whose workdir
    ships `json.py`; see the module's docstring for what must hold."""
    ids = await fleet.register(db, entrypoint=ENTRYPOINT, python=sys.executable)
    vm_id = ids[fleet[0].name]
    logs = {n: tmp_path / f"imports-{n}.log" for n in ("broken", "store", "group")}
    broken_dir = hostile_workdir(tmp_path / "broken", logs["broken"], broken_training=True)
    store_dir = hostile_workdir(tmp_path / "stored", logs["store"])
    group_dir = hostile_workdir(tmp_path / "group", logs["group"])
    store, out = tmp_path / "store", tmp_path / "out"
    broken = await new_job(db, 1, workdir=pack(broken_dir), max_retries=1)
    stored = await new_job(
        db, 1, workdir=pack(store_dir), store=f"file://{store}", output_dir=str(out),
        max_retries=0,
    )  # fmt: skip
    code = "import json, os; print('role ran', os.getcwd())"
    roles = parse_data(
        {"roles": {"main": {"command": [sys.executable, "-c", code, "job-role"], "gpus": 1}}}
    ).to_data()
    group = await new_job(
        db, 1, roles=roles, model="-", dataset="-", reward_functions=("-",),
        workdir=pack(group_dir), max_retries=0,
    )  # fmt: skip
    async with daemons(db, nats.url, CONFIG):
        await wait_vm_healthy(db, vm_id)
        with VMWatch(db, vm_id) as watch:
            deadline = time.monotonic() + 120
            while True:  # the VM stays healthy at every sample: fail at the first that is not
                assert watch.bad == [], watch.bad[:5]
                done = {j: await job_row(db, j) for j in (broken, stored, group)}
                if all(done[j].status in ("completed", "failed") for j in (stored, group)) and (
                    done[broken].retry_decision == "give_up"
                ):
                    break
                assert time.monotonic() < deadline, {j: job.status for j, job in done.items()}
                await asyncio.sleep(0.1)
        assert watch.bad == [], watch.bad[:5]
    seen = {n: importers(log) for n, log in logs.items()}
    # No scheduler helper imported any of the job's modules…
    assert {n: helpers_among(s) for n, s in seen.items()} == {n: [] for n in seen}
    # …while the job's own processes did (the fakes are live).
    assert "training" in {n for n, _ in seen["broken"]}
    assert "training.train_grpo" in {n for n, _ in seen["store"]}
    assert "json" in {n for n, _ in seen["group"]}

    job = done[broken]  # its own failure, counted: never the VM's
    assert (job.status, job.failure_reason, job.exit_code) == ("failed", "exit_nonzero", 1), (
        job.status_reason
    )
    assert (job.attempt, job.retry_count, job.machine_faults) == (2, 1, 0)

    job = done[stored]  # completed by training, not by the fake agent
    folder = Path(job.attempt_dir or "")
    log = (folder / "train.log").read_text()
    assert (job.status, job.attempt, job.retry_count) == ("completed", 1, 0), (
        job.status_reason,
        log,
    )
    assert "fake job trainer ran" in log and "nothing to train" not in log
    assert (out / "trained.txt").is_file()
    base = store / await installation(db) / str(stored)
    assert json.loads((base / "final.json").read_text())["files"].get("trained.txt")
    assert (base / "final" / "trained.txt").is_file()

    job = done[group]
    folder = Path(job.attempt_dir or "")
    assert job.status == "completed", (job.status_reason, (folder / "train.log").read_text())
    assert f"role ran {folder / 'work'}" in (folder / "main.log").read_text()


@pytest.mark.slow
async def test_no_scheduler_helper_imports_a_jobs_workdir_on_the_test_fleet(
    sim_fleet: FleetFactory, db: Database, nats: EmbeddedNats, tmp_path: Path
) -> None:
    fleet = await sim_fleet(1, gpus_per_vm=3)
    await isolation_proof(fleet, db, nats, tmp_path)


@pytest.mark.slow
async def test_no_scheduler_helper_imports_a_jobs_workdir_behind_openssh(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    nats: EmbeddedNats,
    tmp_path: Path,
) -> None:
    fleet = sshd_fleet(1, gpus_per_vm=3)
    await isolation_proof(fleet, db, nats, tmp_path)


def test_the_check_of_a_vms_entrypoint_finds_the_vms_own_not_its_working_directorys(
    tmp_path: Path,
) -> None:
    """The check a poll runs (in $HOME, where a job of the same account may write): run in
    a directory holding a `training/` that raises and a `json.py`, it finds the VM's
    installed `training.train_grpo` and imports neither."""
    log = tmp_path / "imports.log"
    hostile_workdir(tmp_path / "home", log, broken_training=True)
    words = entry_check_words(sys.executable, ENTRYPOINT)
    ran = subprocess.run(
        " ".join(words), shell=True, cwd=tmp_path / "home", capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert (ran.returncode, importers(log)) == (0, []), ran.stdout + ran.stderr


BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"
"""The interpreter the test venv was made from: the scheduler is not installed in it, so a
helper it runs finds the scheduler only through a PYTHONPATH (as on a VM whose
`~/.rlfleet/env` names the checkout)."""
REPO = Path(__file__).resolve().parents[2]


def run_sh(words: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`words` as one `sh -c` command in `cwd`, with nothing of the test's environment but
    PATH, HOME and `env`."""
    base = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(
        ["sh", "-c", " ".join(words)], cwd=cwd, env={**base, **env}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip


def test_a_helper_finds_the_scheduler_through_the_vms_pythonpath_and_nothing_else(
    tmp_path: Path,
) -> None:
    """Given a python without the scheduler, a VM-level PYTHONPATH naming the checkout
    (with an empty and a relative entry beside it) and a working directory holding a fake
    `scheduler/` and `training/`: the isolated store agent and the check run the
    checkout's, never the fakes; without that PYTHONPATH the check says the module is
    missing."""
    if not BASE_PYTHON.exists() or run_sh([str(BASE_PYTHON), "-c", "'import scheduler'"],
                                          tmp_path).returncode == 0:  # fmt: skip
        pytest.skip("needs a python without the scheduler installed")
    log = tmp_path / "imports.log"
    home = hostile_workdir(tmp_path / "home", log)
    vm_path = f":{REPO}:relative"
    agent = module_words(str(BASE_PYTHON), "scheduler.store.agent", ["--help"])
    ran = run_sh(agent, home, PYTHONPATH=vm_path)
    assert ran.returncode == 0 and "--installation" in ran.stdout, ran.stderr
    check = entry_check_words(str(BASE_PYTHON), ENTRYPOINT)
    ran = run_sh(check, home, PYTHONPATH=vm_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    ran = run_sh(check, home)
    assert ran.returncode == 1 and "No module named 'training'" in ran.stderr
    assert importers(log) == []


@pytest.mark.parametrize(
    ("entry", "in_work", "expected"),
    [
        ("training.train_grpo", False, 0),  # the VM's own, installed
        ("training.train_grpo", True, 0),  # the workdir ships `training/`: the job's own
        ("nowhere.train", False, 1),  # neither: the VM cannot start it
        ("nowhere.train", True, 0),  # the workdir ships `nowhere/`
        ("train.py", True, 0),  # relative, with a workdir: resolved there, the job's
        ("train.py", False, 1),  # relative, without: $HOME/train.py, absent
        ("/absent/train.py", True, 1),  # absolute: the VM's file, whatever the workdir
    ],
)
def test_what_the_check_holds_against_the_vm_and_what_it_leaves_to_the_job(
    tmp_path: Path, entry: str, in_work: bool, expected: int
) -> None:
    """The check's decision (docs/security.md, "A job's workdir"): the VM's python and its
    own installation, unless the job's workdir ships the entrypoint (then a failure of it
    is the job's, counted); nothing of the workdir is run to decide."""
    log = tmp_path / "imports.log"
    work = hostile_workdir(tmp_path / "work", log, broken_training=True)
    (work / "nowhere").mkdir()
    (work / "nowhere" / "__init__.py").write_text(MARK.format(log=str(log), name="nowhere"))
    where = shlex.quote(str(work)) if in_work else "''"
    ran = run_sh(entry_check_words(sys.executable, entry, where), tmp_path)
    assert (ran.returncode, importers(log)) == (expected, []), ran.stdout + ran.stderr


def test_the_polls_check_sees_the_vms_env_file_as_the_wrappers_does(tmp_path: Path) -> None:
    """The poll's check of a marked VM (`poll.check_command`) runs with the VM's
    `~/.rlfleet/env` loaded and no other PYTHONPATH, as the wrapper's check does: a VM whose
    `training` is found through the PYTHONPATH set there passes it, whatever PYTHONPATH the
    SSH session has, and the fake `training/` in $HOME is never imported."""
    if not BASE_PYTHON.exists() or run_sh([str(BASE_PYTHON), "-c", "'import training'"],
                                          tmp_path).returncode == 0:  # fmt: skip
        pytest.skip("needs a python without the training package installed")
    log = tmp_path / "imports.log"
    home = hostile_workdir(tmp_path / "home", log, broken_training=True)
    (home / ".rlfleet").mkdir()
    (home / ".rlfleet" / "env").write_text(f"PYTHONPATH={REPO}\n")
    check = " ".join(entry_check_words(str(BASE_PYTHON), ENTRYPOINT))
    script = "\n".join(check_command(check))
    ran = run_sh([script], home, PYTHONPATH=str(home))
    assert f"{CHECK_RC} 0" in ran.stdout, ran.stdout + ran.stderr
    assert importers(log) == []
