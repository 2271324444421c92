"""Jobs under their own Unix account (`vm add --job-user`, scheduler/remote/jobuser.py) on
OpenSSH VMs: the scheduler logs in as S, a fresh non-root account, and the job runs as J
(tests/sshd.py `JobUserAccounts`). The job plays the attacker: from inside it, it tries to
reach what is the scheduler's on its VM."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from scheduler.db import Database
from scheduler.fleet import add_vm, get_vm, set_job_user, vm_to_dict
from scheduler.gpu_poller import GpuPoller
from scheduler.jobs import JobSpec, insert_job, transition
from scheduler.kill import kill_attempt
from scheduler.pull import pull_job
from scheduler.remote.jobuser import JOB_DIR, ready_check
from scheduler.remote.launch import LaunchSpec, launch_input, launch_script, parse_launch
from scheduler.remote.layout import Attempt, default_output_dir, new_token
from scheduler.remote.pull import tar_command
from scheduler.remote.rendezvous import GroupLaunch
from scheduler.remote.workdir import cache_dir
from scheduler.states import JobStatus
from scheduler.transport import SSHTransport
from tests.fleet import FAKE_TRAIN
from tests.sshd import JobUserAccounts, SshdFleet, SshdVM, searchable_root
from tests.workloads.support import current_attempt, place_rank0

pytestmark = pytest.mark.slow

INSTALLATION = "00000000-0000-4000-8000-00000000beef"
VM_PYTHON = "/usr/bin/python3"
"""The VM's python: one S and J may run (this venv's is under root's 0700 home)."""
SECRET = "aws_secret_access_key = rlfleet-test-secret\n"
BASHRC = 'echo read >> "$HOME/.bashrc-read"\n'
"""S's own ~/.bashrc: it notes that bash read it (for the commands sshd runs)."""

ATTACKER = r'''
"""A hostile job: tries what docs/security.md says a job with a job user cannot do."""
import json, os, signal, sys

out = sys.argv[sys.argv.index("--output_dir") + 1]
d = os.path.dirname(os.path.dirname(os.environ["RLFLEET_PROGRESS_FILE"]))
s_home = os.environ["ATTACK_S_HOME"]
tried = {"uid": os.getuid()}

def attempt(name, action):
    try:
        action()
        tried[name] = "done"
    except OSError as exc:
        tried[name] = type(exc).__name__

def write(path):
    def go():
        with open(path, "a") as f:
            f.write("PATH=/tmp/evil:$PATH\n")
    return go

def replace(path):
    def go():
        with open(path + ".evil", "w") as f:
            f.write("0\n")
        os.replace(path + ".evil", path)
    return go

for startup in (".bashrc", ".profile", ".bash_profile", ".ssh/rc"):
    attempt("write " + startup, write(os.path.join(s_home, startup)))
attempt("mkdir in S home", lambda: os.mkdir(os.path.join(s_home, "evil")))
for name in ("exit_code", "pid", "lease", "fenced_reason", "store.json", "launch.sh",
             "cannot_start"):
    attempt("write " + name, write(os.path.join(d, name)))
    attempt("replace " + name, replace(os.path.join(d, name)))
attempt("unlink progress.json link", lambda: os.unlink(os.path.join(d, "progress.json")))
attempt("read credentials", lambda: open(os.path.join(s_home, ".aws", "credentials")).read())
attempt("read vm env", lambda: open(os.path.join(s_home, ".rlfleet", "env")).read())
try:
    with open(os.path.join(d, "pid")) as f:
        wrapper = int(f.read())
except OSError:  # not even readable (a VM tree made with umask 077): S's shell above sudo
    with open(f"/proc/{os.getppid()}/stat") as f:
        wrapper = int(f.read().rsplit(")", 1)[1].split()[1])
attempt("signal wrapper", lambda: os.kill(wrapper, signal.SIGTERM))
attempt("signal sudo", lambda: os.kill(os.getppid(), signal.SIGTERM))
attempt("write own output", write(os.path.join(out, "own.txt")))
attempt("write progress", write(os.environ["RLFLEET_PROGRESS_FILE"]))
attempt("write tmpdir", write(os.path.join(os.environ["TMPDIR"], "t")))
with open(os.path.join(out, "attack.json"), "w") as f:
    json.dump(tried, f)
'''


@pytest.fixture
def accounts() -> Iterator[JobUserAccounts]:
    made = JobUserAccounts()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def vm(accounts: JobUserAccounts) -> Iterator[SshdVM]:
    root = searchable_root("rlfleet-jobuser-")
    fleet = SshdFleet(root / "fleet", accounts)
    (root / "fleet").chmod(0o711)
    try:
        made = fleet.add_vm("ju")
        home = made.home
        # What the scheduler keeps from the job: its credentials and the VM's env file.
        for path, text in ((".aws/credentials", SECRET), (".rlfleet/env", "X=1\n")):
            (home / path).parent.mkdir(mode=0o700, exist_ok=True)
            (home / path).write_text(text)
            (home / path).chmod(0o600)
        (home / ".bashrc").write_text(BASHRC)
        (home / ".bashrc").chmod(0o644)
        for path in home.rglob("*"):
            os.chown(path, accounts.login_uid, accounts.login_uid)
        (root / "attacker.py").write_text(ATTACKER)
        yield made
    finally:
        fleet.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def transport() -> AsyncIterator[SSHTransport]:
    made = SSHTransport()
    try:
        yield made
    finally:
        await made.close()


def _spec(
    vm: SshdVM, job_user: str | None, entrypoint: str, *args: str, **kw: object
) -> LaunchSpec:
    run = Attempt(INSTALLATION, 7, 1, new_token())
    return LaunchSpec(
        run=run,
        python=VM_PYTHON,
        entrypoint=entrypoint,
        gpu_indices=[0],
        model="m",
        dataset="d",
        reward_functions=["format"],
        output_dir=default_output_dir(INSTALLATION, 7),
        extra_args=list(args),
        job_user=job_user,
        **kw,  # type: ignore[arg-type]
    )


async def _launch(
    transport: SSHTransport, vm: SshdVM, spec: LaunchSpec, *, umask: str = "022"
) -> Path:
    """Launch `spec` as the dispatcher does; `umask`: S's (077 as a VM tree kept from
    other accounts has it)."""
    result = await transport.run(
        vm.target, f"umask {umask}\n{launch_script(spec)}", timeout=30, input=launch_input(spec)
    )
    launched = parse_launch(result.stdout, spec.run)
    assert launched is not None and launched.path is not None, result.stdout + result.stderr
    return Path(launched.path)


async def _exit_code(d: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (d / "exit_code").exists() or not (d / "exit_code").read_text().strip():
        assert time.monotonic() < deadline, (d / "train.log").read_text()
        await asyncio.sleep(0.1)
    return (d / "exit_code").read_text().strip()


CONTROL = ("exit_code", "pid", "lease", "fenced_reason", "store.json", "launch.sh", "cannot_start")


@pytest.mark.parametrize("umask", ["022", "077"])
async def test_a_job_user_cannot_reach_what_is_the_schedulers(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport, umask: str
) -> None:
    # Given a VM whose jobs run as J, and a job that tries everything from inside
    spec = _spec(
        vm,
        accounts.job,
        str(vm.root.parent.parent / "attacker.py"),
        env=[("ATTACK_S_HOME", str(vm.home))],
    )
    d = await _launch(transport, vm, spec, umask=umask)
    # When it has run
    assert await _exit_code(d) == "0", (d / "train.log").read_text()
    outputs = vm.home / default_output_dir(INSTALLATION, 7).removeprefix("~/")
    tried = json.loads((outputs / "attack.json").read_text())
    # Then it ran as J, wrote its own outputs, progress and temp files
    assert tried.pop("uid") == accounts.job_uid
    for own in ("write own output", "write progress", "write tmpdir"):
        assert tried.pop(own) == "done", own
    # And everything of the scheduler's was refused: S's startup files (nothing it can
    # change runs for S's commands, `job pull`'s tar included), the attempt's control
    # files, the store credentials and the VM's env file, a signal to the wrapper
    assert {what: how for what, how in tried.items() if how == "done"} == {}
    assert (vm.home / ".bashrc").read_text() == BASHRC
    assert not (vm.home / "evil").exists()
    for name in CONTROL:
        assert not (d / f"{name}.evil").exists()
    assert (d / "exit_code").read_text() == "0\n"
    assert (d / "progress.json").is_symlink()
    # And the scheduler's account reads what the job made (what `job pull` sends)
    pulled = await transport.run(
        vm.target, f"{tar_command(spec.output_dir, None)} | tar -tf -", timeout=20
    )
    assert pulled.exit_status == 0, pulled.stderr
    assert {"./attack.json", "./own.txt"} <= set(pulled.stdout.split())
    if Path("/bin/bash").exists():  # S's commands read S's ~/.bashrc, which J cannot change
        assert (vm.home / ".bashrc-read").is_file()
    read = await transport.run(vm.target, f'cat "{d}/{JOB_DIR}/tmp/t"', timeout=20)
    assert read.exit_status == 0 and "evil" in read.stdout, read.stderr


def _live(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


async def test_cancel_stops_every_process_of_a_job_user_attempt(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    # Given a job running as J that also left its process group (a child in a session
    # of its own, as a careless or hostile job may)
    spec = _spec(vm, accounts.job, str(FAKE_TRAIN), "--fake_seconds", "120", "--fake_setsid_child")
    d = await _launch(transport, vm, spec)
    outputs = vm.home / default_output_dir(INSTALLATION, 7).removeprefix("~/")
    deadline = time.monotonic() + 20
    while not (outputs / "setsid_child.pid").exists():
        assert time.monotonic() < deadline, (d / "train.log").read_text()
        await asyncio.sleep(0.1)
    assert _live(accounts.job_uid), "the job does not run as J"
    # When the scheduler cancels it (the kill every cancel, fence and sweep uses)
    target = vm.target.__class__(**{**vm.target.__dict__, "job_user": accounts.job})
    result = await kill_attempt(transport, target, spec.run.located(str(d)), grace_s=5)
    # Then every process of J's is gone, the one outside the group too
    assert result.dead, result
    deadline = time.monotonic() + 10
    while _live(accounts.job_uid):
        assert time.monotonic() < deadline, f"J's processes outlived the cancel: {result}"
        await asyncio.sleep(0.1)


ROLE = r"""
import os, sys
with open(os.path.join(sys.argv[1], "role.txt"), "w") as f:
    f.write(str(os.getuid()))
print("role done")
"""


@pytest.mark.parametrize("umask", ["022", "077"])
async def test_a_group_supervisor_and_its_roles_run_as_the_job_user(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport, umask: str
) -> None:
    # Given a job group's attempt (its supervisor and one role) on a VM with a job user
    role = vm.root.parent.parent / "role.py"
    role.write_text(ROLE)
    outputs = vm.home / default_output_dir(INSTALLATION, 7).removeprefix("~/")
    config = {
        "roles": [
            {
                "name": "work",
                "argv": [VM_PYTHON, str(role), str(outputs)],
                "env": {},
                "primary": True,
                "depends_on": [],
                "live": False,
            }
        ],
        "checks": {},
        "env": {},
        "grace_s": 2,
        "stop_grace_s": 2,
    }
    spec = _spec(vm, accounts.job, str(FAKE_TRAIN), group=GroupLaunch(config, False))
    d = await _launch(transport, vm, spec, umask=umask)
    # Then it ends well, its role ran as J, and what the supervisor wrote (as J) is read
    # by the scheduler's account through S's links
    assert await _exit_code(d) == "0", (d / "train.log").read_text()
    assert (outputs / "role.txt").read_text() == str(accounts.job_uid)
    read = await transport.run(vm.target, f'cat "{d}/roles.json" "{d}/work.log"', timeout=20)
    assert read.exit_status == 0, read.stderr
    assert '"work"' in read.stdout and "role done" in read.stdout
    assert (d / "roles.json").is_symlink() and (d / "work.log").is_symlink()


WORKER = r"""
import os, sys
import helper  # from the job's workdir, first on PYTHONPATH
with open("helper.py", "a") as f:  # its working copy: the job's to change
    f.write("# changed by the job\n")
out = sys.argv[sys.argv.index("--output_dir") + 1]
with open(os.path.join(out, "cwd.txt"), "w") as f:
    f.write(os.getcwd() + "\n" + helper.NAME)
"""


async def test_a_job_user_writes_its_own_working_copy_of_the_workdir(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    # Given a workdir cached on the VM (S's, as `ensure_workdir` leaves it)
    digest = "ab" * 32
    cache = vm.home / cache_dir(INSTALLATION, digest)
    cache.mkdir(parents=True)
    (cache / "helper.py").write_text("NAME = 'from the workdir'\n")
    (cache / "worker.py").write_text(WORKER)
    for path in [*cache.parents, cache, *cache.rglob("*")]:
        if path.is_relative_to(vm.home) and path != vm.home:
            os.chown(path, accounts.login_uid, accounts.login_uid)
    # When a job with that workdir runs as J
    spec = _spec(vm, accounts.job, "worker.py", workdir=digest)
    d = await _launch(transport, vm, spec)
    assert await _exit_code(d) == "0", (d / "train.log").read_text()
    # Then it ran in its own copy, and changed it; the cache is untouched
    outputs = vm.home / default_output_dir(INSTALLATION, 7).removeprefix("~/")
    cwd, name = (outputs / "cwd.txt").read_text().split("\n")
    assert name == "from the workdir"
    assert Path(cwd).resolve() == (d / JOB_DIR / "work").resolve()
    assert (d / JOB_DIR / "work" / "helper.py").read_text().endswith("# changed by the job\n")
    assert "changed" not in (cache / "helper.py").read_text()


async def test_a_vm_where_sudo_to_the_job_user_fails_cannot_start_training(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    # Given a VM whose job user S has no sudo rule for (`nobody`)
    spec = _spec(vm, "nobody", str(FAKE_TRAIN))
    # When an attempt is launched there
    d = await _launch(transport, vm, spec)
    # Then training never starts: the wrapper's own check says the VM cannot start it
    # (127 and `cannot_start`, the VM's fault, not the job's) and why
    assert await _exit_code(d) == "127"
    assert (d / "cannot_start").read_text().strip() == "127"
    assert "sudo -n -u nobody does not work" in (d / "train.log").read_text()
    assert not (d / JOB_DIR).exists()
    # And the poll's readiness check fails the same way until sudo works
    target = vm.target.__class__(**{**vm.target.__dict__, "job_user": "nobody"})
    checked = await transport.run(target, ready_check(target, "true"), timeout=20)
    assert checked.exit_status == 127 and "does not work" in checked.stdout
    good = vm.target.__class__(**{**vm.target.__dict__, "job_user": accounts.job})
    assert (await transport.run(good, ready_check(good, "true"), timeout=20)).exit_status == 0


async def test_a_fence_stops_every_process_of_a_job_user_attempt(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    # Given a job running as J, with a child outside its process group, whose lease is
    # never renewed (the scheduler lost contact with the VM)
    spec = _spec(
        vm,
        accounts.job,
        str(FAKE_TRAIN),
        "--fake_seconds",
        "120",
        "--fake_setsid_child",
        fence_after_s=2,
        fence_grace_s=2,
    )
    d = await _launch(transport, vm, spec)
    # When the watchdog fences it
    await _exit_code(d, timeout=40)
    assert (d / "fenced_reason").is_file(), (d / "train.log").read_text()
    # Then none of J's processes is left, the one outside the group included
    deadline = time.monotonic() + 15
    while _live(accounts.job_uid):
        assert time.monotonic() < deadline, (d / "train.log").read_text()
        await asyncio.sleep(0.2)


async def test_a_job_users_outputs_reach_its_store_through_the_schedulers_agent(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    # Given a store only S can write (its agent runs as S, with S's credentials)
    store = vm.root / "store"
    store.mkdir(mode=0o700)
    os.chown(store, accounts.login_uid, accounts.login_uid)
    env_file = vm.home / ".rlfleet" / "env"
    env_file.write_text(f"PYTHONPATH={Path(__file__).resolve().parents[2]}\n")  # the agent
    # When a job runs to its end as J (the attacker: it writes two output files)
    spec = _spec(
        vm,
        accounts.job,
        str(vm.root.parent.parent / "attacker.py"),
        env=[("ATTACK_S_HOME", str(vm.home))],
        store=f"file://{store}",
    )
    d = await _launch(transport, vm, spec)
    assert await _exit_code(d, timeout=60) == "0", (d / "train.log").read_text()
    # Then S's agent read J's output directory and made the final upload; its status file
    # is S's
    names = {p.name for p in store.rglob("*")}
    assert {"final.json", "attack.json", "own.txt"} <= names, sorted(names)
    assert not (d / "store_error").exists(), (d / "train.log").read_text()
    assert (d / "store.json").stat().st_uid == accounts.login_uid


ROTATE = r"""
import os, shutil, sys
out = sys.argv[sys.argv.index("--output_dir") + 1]
shutil.rmtree(os.path.join(out, "checkpoint-1"))  # as a trainer's save_total_limit does
"""


async def test_a_job_user_may_rotate_away_a_checkpoint_its_agent_restored(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    # Given a job with a store whose output directory holds a checkpoint S's agent wrote
    # (a restore runs as S, before training)
    store = vm.root / "store"
    store.mkdir(mode=0o700)
    os.chown(store, accounts.login_uid, accounts.login_uid)
    (vm.home / ".rlfleet" / "env").write_text(f"PYTHONPATH={Path(__file__).resolve().parents[2]}\n")
    outputs = vm.home / default_output_dir(INSTALLATION, 7).removeprefix("~/")
    (outputs / "checkpoint-1").mkdir(parents=True)
    (outputs / "checkpoint-1" / "weights.bin").write_bytes(b"w" * 100)
    for path in (vm.home / ".rlfleet").rglob("*"):
        os.chown(path, accounts.login_uid, accounts.login_uid)
    rotate = vm.root.parent.parent / "rotate.py"
    rotate.write_text(ROTATE)
    # When the job, as J, removes that checkpoint (a trainer's rotation)
    spec = _spec(vm, accounts.job, str(rotate), store=f"file://{store}")
    d = await _launch(transport, vm, spec)
    # Then it may: what S restored is the job's to change
    assert await _exit_code(d, timeout=60) == "0", (d / "train.log").read_text()
    assert not (outputs / "checkpoint-1").exists()


async def test_bootstrap_sets_a_job_user_up_and_jobs_then_run_as_it(
    transport: SSHTransport,
) -> None:
    # Given a VM whose login S may sudo to root (once), and no job user yet
    accounts = JobUserAccounts(by_bootstrap=True)
    root = searchable_root("rlfleet-bootstrap-")
    fleet = SshdFleet(root / "fleet", accounts)
    (root / "fleet").chmod(0o711)
    try:
        vm = fleet.add_vm("boot")
        (vm.home / ".aws").mkdir()
        (vm.home / ".aws" / "credentials").write_text(SECRET)
        for path in [vm.home / ".aws", vm.home / ".aws" / "credentials"]:
            os.chown(path, accounts.login_uid, accounts.login_uid)
        (vm.home / ".aws" / "credentials").chmod(0o644)  # too open: the script tightens it
        public = vm.known_hosts_path.read_text().split()[1:3]
        (root / "host_key.pub").write_text(" ".join(public) + "\n")
        script = (Path(__file__).resolve().parents[2] / "deploy" / "bootstrap-vm.sh").read_text()
        args = (
            f"--venv rlfleet-venv --no-install --allow-no-gpu --python {VM_PYTHON}"
            f" --host-key {root / 'host_key.pub'} --hostname 127.0.0.1 --port {vm.port}"
            f" --job-user {accounts.job}"
        )
        # When bootstrap-vm.sh --job-user runs there as S
        result = await transport.run(vm.target, f"bash -s -- {args}", timeout=120, input=script)
        assert result.exit_status == 0, result.stdout + result.stderr
        accounts.refresh()
        # Then J exists, S may start anything as J without a password (and no more), S's home
        # is searchable (only) by group J, and the credentials are S's alone
        assert accounts.job_uid > 0
        assert f"--job-user {accounts.job}" in result.stdout
        rule = Path(f"/etc/sudoers.d/rlfleet-job-user-{accounts.login}")
        assert f"{accounts.login} ALL=({accounts.job}) NOPASSWD: ALL" in rule.read_text()
        assert rule.stat().st_mode & 0o777 == 0o440 and rule.stat().st_uid == 0
        home = vm.home.stat()
        assert home.st_gid == accounts.job_gid and home.st_mode & 0o070 == 0o010
        assert (vm.home / ".aws" / "credentials").stat().st_mode & 0o777 == 0o600
        # And a job launched there (over a new login, with S now in group J) runs as J
        await transport.close()
        spec = _spec(vm, accounts.job, str(FAKE_TRAIN), "--max_steps", "2")
        d = await _launch(transport, vm, spec)
        assert await _exit_code(d) == "0", (d / "train.log").read_text()
        assert (d / JOB_DIR / "progress.json").stat().st_uid == accounts.job_uid
        # And a bad --job-user is a usage error (exit 2), before anything changes
        bad = await transport.run(
            vm.target, "bash -s -- --no-install --job-user 'Bad Name'", timeout=60, input=script
        )
        assert bad.exit_status == 2 and "POSIX user name" in bad.stderr
    finally:
        fleet.close()
        accounts.close()
        shutil.rmtree(root, ignore_errors=True)


async def test_the_poller_says_whether_sudo_to_the_job_user_works(
    vm: SshdVM, accounts: JobUserAccounts, db: Database
) -> None:
    # Given the VM registered with a job user S has no sudo rule for
    async with db.transaction() as session:
        row = await add_vm(
            session, dataclasses.replace(vm.spec(python=VM_PYTHON), job_user="nobody")
        )
        vm_id = row.id
    transport = SSHTransport()
    try:
        poller = GpuPoller(db, transport)
        # When the poller polls it, then it is unhealthy, and `vm show` says why
        await poller.sweep()
        async with db.transaction() as session:
            shown = vm_to_dict(await get_vm(session, vm.name), gpus=False)
        assert shown["status"] == "unhealthy", shown
        assert "sudo -n -u nobody does not work" in (shown["launch_error"] or ""), shown
        # When its job user is the one S may start jobs as, then the next poll clears it
        async with db.transaction() as session:
            await set_job_user(session, vm.name, accounts.job)
        await poller.sweep()
        async with db.transaction() as session:
            shown = vm_to_dict(await get_vm(session, vm.name), gpus=False)
        assert (shown["status"], shown["launch_error"]) == ("healthy", None), shown
        assert shown["id"] == vm_id
    finally:
        await transport.close()


SAVER = r"""
import os, sys
out = sys.argv[sys.argv.index("--output_dir") + 1]
os.makedirs(os.path.join(out, "checkpoint-1"))
with open(os.path.join(out, "checkpoint-1", "model.bin"), "wb") as f:
    f.write(b"weights of J" * 100)
"""


async def test_job_pull_brings_back_what_a_job_user_wrote(
    vm: SshdVM, accounts: JobUserAccounts, db: Database, transport: SSHTransport, tmp_path: Path
) -> None:
    # Given a job on a VM with a job user, whose attempt (as J) saved a checkpoint
    async with db.transaction() as session:
        row = await add_vm(
            session, dataclasses.replace(vm.spec(python=VM_PYTHON), job_user=accounts.job)
        )
        vm_id = row.id
        job = await insert_job(session, JobSpec("m", "d", ("format",)), actor="test")
        values = {"vm_id": vm_id, "attempt": 1, "gpu_indices": [0], "launch_token": new_token()}
        await transition(
            session, job.id, expected=JobStatus.QUEUED, to=JobStatus.STARTING,
            reason="claimed", actor="test", values=values,
        )  # fmt: skip
        await place_rank0(session, job.id)
        job_id = job.id
    run = await current_attempt(db, job_id)
    saver = vm.root.parent.parent / "saver.py"
    saver.write_text(SAVER)
    spec = dataclasses.replace(
        _spec(vm, accounts.job, str(saver)),
        run=run,
        output_dir=default_output_dir(run.installation, job_id),
    )
    d = await _launch(transport, vm, spec)
    assert await _exit_code(d) == "0", (d / "train.log").read_text()
    # When `job pull` fetches that checkpoint (over SSH, as S)
    dest = tmp_path / "pulled"
    got = await pull_job(db, transport, job_id, dest, checkpoint=1)
    # Then what J wrote came back whole
    assert (dest / "model.bin").read_bytes() == b"weights of J" * 100, got


async def test_the_job_users_path_never_picks_what_the_scheduler_runs_as_itself(
    vm: SshdVM, accounts: JobUserAccounts, transport: SSHTransport
) -> None:
    """The wrapper hands the job to J through `env` and `sudo` after the job's environment
    is loaded: those must be the scheduler account's, found on its own PATH, never in a
    directory the job's PATH names that J can write (J's `env` run as S would be S)."""
    # Given a directory J owns with its own `env` and `sudo`, first on the job's PATH
    trap = vm.root.parent.parent / "trap"
    trap.mkdir()
    marks = trap / "ran-as"
    for tool in ("env", "sudo"):
        fake = trap / tool
        fake.write_text(f'#!/bin/sh\nid -un >> {marks}\nexec /usr/bin/{tool} "$@"\n')
        fake.chmod(0o755)
    for path in (trap, *trap.iterdir()):
        os.chown(path, accounts.job_uid, accounts.job_gid)
    marks.touch()
    marks.chmod(0o666)  # whoever runs the fakes says so
    (vm.root.parent.parent / "ok.py").write_text("print('trained')\n")
    spec = _spec(
        vm,
        accounts.job,
        str(vm.root.parent.parent / "ok.py"),
        env=[("PATH", f"{trap}:/usr/local/bin:/usr/bin:/bin")],
    )
    # When the job runs
    d = await _launch(transport, vm, spec)
    assert await _exit_code(d) == "0", (d / "train.log").read_text()
    # Then the training ran, and nothing of J's ran as the scheduler's account
    assert "trained" in (d / "train.log").read_text()
    assert accounts.login not in marks.read_text().split(), marks.read_text()
