"""Issue 29's critical case end to end with `--job-user`: a job on an OpenSSH VM whose jobs
run as their own Unix account J (the scheduler logs in as S, whose shell is bash; real
accounts made with useradd, tests/sshd.py `JobUserAccounts`) tries to write outside DEST on
the machine that runs `rlfleet job pull`, through the real CLI and real Postgres.

Every attack step is the training command of a real attempt, launched as the dispatcher
launches it (`launch_script`: S's wrapper, then sudo to J), so it runs as J with J's
environment, umask and directories; the proofs are those of test_pull_hostile.py, given a
`JobUserJob`. The VM is registered with `rlfleet vm add … --job-user J`."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, cast

import pytest

from scheduler.db import Database
from scheduler.remote.layout import Attempt, new_token
from scheduler.transport import SSHTransport, Transport
from tests.acceptance.test_cli_input import add_polled_vm, env, rlfleet
from tests.acceptance.test_pull_hostile import (
    _JOB_STEPS,
    job_writes,
    result_of,
    s3,
    store_pull_escape_proof,
    vm_pull_escape_proof,
)
from tests.integration.test_job_user import (
    INSTALLATION,
    VM_PYTHON,
    _exit_code,
    _launch,
    _spec,
    accounts,
    vm,
)
from tests.s3server import S3Server
from tests.sshd import JobUserAccounts, SshdVM
from tests.workloads.support import installation

__all__ = ["accounts", "env", "s3", "vm"]

pytestmark = pytest.mark.slow

REPO = str(Path(__file__).resolve().parents[2])
"""On J's PYTHONPATH for the store writes (the scheduler's store code, run by J)."""


class JobUserJob:
    """The job as J: each `run` is a real attempt whose training command is the script."""

    own_account = True

    def __init__(
        self, transport: Transport, vm: SshdVM, accounts: JobUserAccounts, outputs: Path
    ) -> None:
        self.transport, self.vm, self.accounts = transport, vm, accounts
        self.home = vm.home  # S's: what S's bash reads is S's own ~/.bashrc
        self.outputs = outputs  # the attempts' output directory: group J, 2770
        self.bash_login = Path("/bin/bash").exists()  # S's shell (JobUserAccounts)
        self.attempts = 0

    async def run(self, script: str, plan: object) -> Any:
        self.attempts += 1
        path = self.vm.root.parent.parent / f"job-{self.attempts}.py"  # J may read it
        path.write_text(f"import os\nprint('UID', os.getuid())\n{script}")
        path.with_suffix(".json").write_text(json.dumps(plan))
        env = [("JOB_PLAN", str(path.with_suffix(".json"))), ("PYTHONPATH", REPO)]
        spec = dataclasses.replace(
            _spec(self.vm, self.accounts.job, str(path), env=env),
            run=Attempt(INSTALLATION, 7, self.attempts, new_token()),
            output_dir=str(self.outputs),
        )
        d = await _launch(cast(SSHTransport, self.transport), self.vm, spec)  # uses `run`
        log = d / "train.log"
        assert await _exit_code(d, timeout=60) == "0", log.read_text()
        assert f"UID {self.accounts.job_uid}\n" in log.read_text(), "not run as J"
        return result_of(log.read_text())


def register(env: dict[str, str], vm: SshdVM, accounts: JobUserAccounts) -> int:
    """`rlfleet vm add` of the VM, its jobs run as J; its id."""
    t = vm.target
    added = rlfleet(
        env, "vm", "add", vm.name, "--host", t.host, "--port", str(t.port), "--user", vm.login,
        "--ssh-key", str(t.ssh_key_path), "--known-hosts", str(vm.known_hosts_path),
        "--python", VM_PYTHON, "--job-user", accounts.job, "--json",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    return int(json.loads(added.stdout)["id"])


async def test_a_job_user_without_a_store_cannot_write_outside_dest_through_job_pull(
    vm: SshdVM,  # noqa: F811
    accounts: JobUserAccounts,  # noqa: F811
    env: dict[str, str],  # noqa: F811
    transport: Transport,
    tmp_path: Path,
) -> None:
    # Given a VM whose jobs run as J, S logging in with bash, S's own ~/.bashrc
    vm_id = register(env, vm, accounts)
    add_polled_vm(env, "gpu-1", 1)  # `job submit` wants a VM the job could run on
    job = JobUserJob(transport, vm, accounts, vm.home / "job-out")
    root = tmp_path / "puller"
    root.mkdir()
    # When the job (as J) tries everything, then nothing outside DEST is written
    await vm_pull_escape_proof(env, job, vm_id, root)
    assert job.attempts == 5


async def test_a_job_user_with_a_store_cannot_write_outside_dest_through_job_pull(
    vm: SshdVM,  # noqa: F811
    accounts: JobUserAccounts,  # noqa: F811
    env: dict[str, str],  # noqa: F811
    db: Database,
    transport: Transport,
    s3: S3Server,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Given a VM whose jobs run as J, with S's store credentials in S's ~/.aws (0600)
    register(env, vm, accounts)
    add_polled_vm(env, "gpu-1", 1)
    s3.aws_files(vm.home)
    for path in (vm.home / ".aws").rglob("*"):
        os.chown(path, accounts.login_uid, accounts.login_uid)
    inst = await installation(db)
    job = JobUserJob(transport, vm, accounts, vm.home / "job-out")
    # Then J reads none of S's credentials, and without them its PUT into the S3 store is
    # refused (the server answers a request with no signature UnsupportedAlgorithm)
    creds = vm.home / ".aws" / "credentials"
    put = f"{s3.endpoint}/{s3.bucket}/runs/{inst}/evil"
    tried = await job.run(_JOB_STEPS, [("read", str(creds)), ("http_put", put)])
    assert tried == ["PermissionError", "HTTPError 400 UnsupportedAlgorithm"], tried
    assert s3.objects() == []
    # And a directory store only S writes (as the store agent runs as S): J cannot write it
    s_only = vm.root / "store-s"
    s_only.mkdir(mode=0o700)
    os.chown(s_only, accounts.login_uid, accounts.login_uid)
    tried = await job_writes(job, f"file://{s_only}", inst, 1, {"put": {"final.json": "{}"}})
    assert "PermissionError" in tried or "Permission denied" in tried, tried
    assert list(s_only.iterdir()) == []
    # And a directory store J can write (a share its group may write): whatever J puts
    # there, each pull of it is refused or honest, and nothing outside DEST is written
    shared = vm.root / "store-j"
    shared.mkdir()
    os.chown(shared, accounts.login_uid, accounts.job_gid)
    shared.chmod(0o2770)
    root = tmp_path / "puller-file"
    root.mkdir()
    await store_pull_escape_proof(env, job, inst, f"file://{shared}", root)
