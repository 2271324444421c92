"""Issue 29's critical case end to end: a job on an OpenSSH VM account (tests/sshd.py, the
real sshd; the account's shell is bash, as on most VMs) tries to write outside DEST on the
machine that runs `rlfleet job pull`, through the real CLI, real Postgres and, for a job
with a store, a directory store and the real S3 API of tests/s3server.py.

What the job does is a script run as the job (`JobSide`): without a job user, run on the VM
over SSH as its account (`SharedAccountJob`), writing into that account's home (its
`~/.bashrc`, its output directories) and, for a store, with the VM's python and AWS
configuration; with one, the training command of a real attempt launched as the job's own
account (tests/acceptance/test_pull_hostile_job_user.py). The proofs take the `JobSide`, so
each variant runs the same attack."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pwd
import shlex
import stat
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from scheduler.db import Database
from scheduler.transport import Transport
from tests.acceptance.test_cli_input import (
    SUBMIT,
    add_polled_vm,
    assert_one_line,
    env,
    rlfleet,
    sql,
)
from tests.s3server import S3Server
from tests.sshd import SshdFleet, SshdVM, sshd_fleet  # noqa: F401 (the fixture)
from tests.unit.test_untar import cve_2025_4517_stream, entry, tar_of
from tests.workloads.support import installation

__all__ = ["env"]

pytestmark = pytest.mark.slow

OPERATOR = {".bashrc": b"# the operator's own startup file\n", "notes.txt": b"kept\n"}


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path / "s3")
    try:
        yield server
    finally:
        server.stop()


def operator_dir(root: Path) -> Path:
    """A directory of the operator's, beside the destinations: what a job must not reach."""
    home = root / "operator"
    home.mkdir()
    for name, data in OPERATOR.items():
        (home / name).write_bytes(data)
    return home


def assert_untouched(home: Path) -> None:
    assert sorted(p.name for p in home.iterdir()) == sorted(OPERATOR)
    for name, data in OPERATOR.items():
        assert (home / name).read_bytes() == data, name


def assert_plain_tree(dest: Path) -> None:
    """Only directories and regular files of one link each, all inside `dest`."""
    real = os.path.realpath(dest)
    for dirpath, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            assert stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1)
            assert os.path.realpath(path).startswith(real + os.sep), path


def pulled(env: dict[str, str], job_id: int, dest: Path, *extra: str) -> dict:
    done = rlfleet(env, "job", "pull", str(job_id), str(dest), "--json", *extra)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return json.loads(done.stdout)


def new_job(env: dict[str, str], vm_id: int, output_dir: Path, *extra: str) -> int:
    """A job that completed on the VM, its outputs in `output_dir` there."""
    submitted = rlfleet(env, *SUBMIT, "--output-dir", str(output_dir), *extra, "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(json.loads(submitted.stdout)["id"])
    sql(env["RLFLEET_DATABASE_URL"],
        f"UPDATE jobs SET status = 'completed', vm_id = {vm_id} WHERE id = {job_id}")  # fmt: skip
    return job_id


def hostile_stream(operator: Path) -> bytes:
    """Every shape that got past the `data` filter or that no filter should take: a link
    extracted before the chain it goes through then a file through it, an absolute name, a
    hard link to the operator's file, and the CVE-2025-4517 chain to `../operator` (DEST's
    parent holds the operator's directory) overwriting their `.bashrc`."""
    first = tar_of(
        entry("l", tarfile.SYMTYPE, link="sub/up/.."),
        entry("sub", tarfile.DIRTYPE, mode=0o755),
        entry("sub/up", tarfile.SYMTYPE, link=".."),
        entry("l/operator/notes.txt", data=b"overwritten\n"),
        entry(str(operator / "abs"), data=b"absolute\n"),
        entry("hard", tarfile.LNKTYPE, link=str(operator / ".bashrc")),
    )
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        tar.getmembers()
        end = tar.offset  # where its end-of-archive blocks start
    return first[:end] + cve_2025_4517_stream("../operator", ".bashrc", b"echo pwned\n")


def bash_reads_bashrc() -> bool:
    return pwd.getpwuid(os.getuid()).pw_shell.endswith("/bash")


_JOB_STEPS = r"""
import base64, json, os, sys

done = []
for op, path, *args in json.load(open(os.environ["JOB_PLAN"])):
    try:
        if op == "mkdir":
            os.makedirs(path, exist_ok=True)
        elif op == "write":
            with open(path, "wb") as f:
                f.write(base64.b64decode(args[0]))
            if args[1] is not None:
                os.chmod(path, args[1])
        elif op == "symlink":
            os.symlink(args[0], path)
        elif op == "link":
            os.link(args[0], path)
        elif op == "fifo":
            os.mkfifo(path)
        elif op == "sparse":
            os.truncate(path, args[0])
        elif op == "read":
            open(path, "rb").read()
        elif op == "http_put":  # path: a URL
            import urllib.request
            urllib.request.urlopen(urllib.request.Request(path, b"x", method="PUT"), timeout=20)
        done.append("done")
    except OSError as exc:  # an HTTP error: with its status and S3 error code
        why = type(exc).__name__
        if isinstance(getattr(exc, "code", None), int):
            body = exc.read().decode(errors="replace")
            why += f" {exc.code} " + body.partition("<Code>")[2].partition("</Code>")[0]
        done.append(why)
print("RESULT " + json.dumps(done))
"""

Step = tuple[object, ...]


class JobSide(Protocol):
    """The job, on its VM: `run` runs a script (`_JOB_STEPS`, `_JOB_WRITES`) as the job,
    `JOB_PLAN` (the path of a JSON file) in its environment, and returns what it printed after
    `RESULT `. `home`: the VM account's home (whose `~/.bashrc` bash reads for the
    scheduler's commands); `outputs`: a directory the job writes its outputs under;
    `own_account`: whether the job runs as an account of its own (`--job-user`);
    `bash_login`: whether the VM account's shell is bash (it reads `home`'s `~/.bashrc`)."""

    home: Path
    outputs: Path
    own_account: bool
    bash_login: bool

    async def run(self, script: str, plan: object) -> Any: ...


def result_of(text: str) -> Any:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, text
    return json.loads(lines[-1].removeprefix("RESULT "))


class SharedAccountJob:
    """A job that shares the scheduler's VM account: its scripts run there over SSH."""

    own_account = False

    def __init__(self, transport: Transport, vm: SshdVM) -> None:
        self.transport, self.vm = transport, vm
        self.home = self.outputs = vm.home
        self.bash_login = bash_reads_bashrc()

    async def run(self, script: str, plan: object) -> Any:
        path = self.vm.home / ".job-script.py"
        path.write_text(script)
        path.with_suffix(".json").write_text(json.dumps(plan))
        plan_word = shlex.quote(f"JOB_PLAN={path.with_suffix('.json')}")
        command = f"{plan_word} {shlex.join([sys.executable, str(path)])}"
        done = await self.transport.run(self.vm.target, command, timeout=60)
        assert done.exit_status == 0, done.stderr
        return result_of(done.stdout)


def written(path: Path, data: bytes, mode: int | None = None) -> Step:
    return ("write", str(path), base64.b64encode(data).decode(), mode)


def outputs_plan(where: Path) -> list[Step]:
    return [
        ("mkdir", str(where / "adapter")),
        written(where / "model.safetensors", b"weights" * 1000),
        written(where / "adapter" / "adapter_config.json", b"{}"),
    ]


def all_done(tried: list[str]) -> None:
    assert set(tried) == {"done"}, tried


async def vm_pull_escape_proof(env: dict[str, str], job: JobSide, vm_id: int,
                               root: Path) -> None:  # fmt: skip
    """A job without a store (`job`: on its VM, as its account) tries to write outside
    DEST through `job pull` (`root` holds the destinations and the operator's directory
    they must not reach):

    1. with nothing but its own output files: links (a link extracted before the chain it
       goes through, an absolute one out), a hard link, a FIFO;
    2. with a `~/.bashrc` that puts a `tar` of its own first on PATH, which prints a
       hostile stream;
    3. with a `~/.bashrc` that redefines `exec` and `/usr/bin/env` (bash runs functions
       before builtins and before absolute paths): no command can avoid its stream;
    4. with a sparse file far past `--max-size`.

    Each pull leaves in DEST only directories and regular files, inside it, and nothing
    outside DEST changes; a refused one leaves nothing. A job with an account of its own
    cannot write the VM account's `~/.bashrc` (the kernel refuses it), so 2. and 3. get
    the real tar's stream."""
    operator = operator_dir(root)
    # 1. Its own output files.
    own = job.outputs / "out-own"
    steps = outputs_plan(own)
    for i in range(8):
        steps += [("mkdir", str(own / f"s{i}")), ("symlink", str(own / f"s{i}" / "up"), ".."),
                  ("symlink", str(own / f"l{i}"), f"s{i}/up/..")]  # fmt: skip
    steps += [("symlink", str(own / "escape"), str(operator)),
              ("link", str(own / "hard"), str(own / "model.safetensors")),
              ("fifo", str(own / "fifo"))]  # fmt: skip
    all_done(await job.run(_JOB_STEPS, steps))
    vm_job = new_job(env, vm_id, own)
    result = pulled(env, vm_job, root / "own")
    assert_untouched(operator)
    assert_plain_tree(root / "own")
    assert result["skipped"] == 19 and "escape" in result["skipped_names"], result
    assert (root / "own" / "adapter" / "adapter_config.json").read_text() == "{}"
    shown = rlfleet(env, "job", "pull", str(vm_job), str(root / "own-text"))
    assert shown.returncode == 0 and "left out: 19 entries" in shown.stdout, shown
    # 2. and 3. Its ~/.bashrc (read by bash for every command sshd runs).
    evil = job.outputs / ".evil"
    stream = shlex.quote(str(evil / "stream.tar"))
    all_done(await job.run(_JOB_STEPS, [
        ("mkdir", str(evil)), written(evil / "stream.tar", hostile_stream(operator)),
        written(evil / "tar", f"#!/bin/sh\nexec cat {stream}\n".encode(), 0o755),
        *outputs_plan(job.outputs / "out-rc"),
    ]))  # fmt: skip
    vm_job = new_job(env, vm_id, job.outputs / "out-rc")
    bashrc = job.home / ".bashrc"
    before = bashrc.read_bytes() if bashrc.exists() else None
    rcs = {
        "path": f"PATH={shlex.quote(str(evil))}:$PATH\n",
        "functions": f"exec() {{ cat {stream}; builtin exit 0; }}\n"
        f"/usr/bin/env() {{ cat {stream}; }}\n",
    }
    for case, rc in rcs.items():
        rc = f'echo read >> "$HOME/.bashrc-read"\n{rc}'
        try:
            tried = await job.run(_JOB_STEPS, [written(bashrc, rc.encode())])
            (job.home / ".bashrc-read").unlink(missing_ok=True)  # what the pull's bash reads
            result = pulled(env, vm_job, root / case)
        finally:
            if not job.own_account:
                bashrc.unlink(missing_ok=True)
        if job.own_account:  # refused by the kernel: S's startup file is S's
            assert tried == ["PermissionError"], tried
            assert (bashrc.read_bytes() if bashrc.exists() else None) == before
        else:
            assert tried == ["done"], tried
        assert_untouched(operator)
        assert_plain_tree(root / case)
        if job.bash_login:
            assert (job.home / ".bashrc-read").is_file(), "sshd's bash did not read ~/.bashrc"
        if case == "path" or job.own_account:  # tar by absolute path: the real one ran
            assert result["skipped"] == 0 and (root / case / "model.safetensors").is_file()
        else:  # the stream reached the reader
            assert result["skipped"] >= 5 and "l" in result["skipped_names"], result
    # 4. A sparse file far past --max-size: refused, one line, nothing left.
    big = job.outputs / "out-big"
    sparse = ("sparse", str(big / "sparse.bin"), 64 << 20)
    all_done(
        await job.run(_JOB_STEPS, [*outputs_plan(big), written(big / "sparse.bin", b""), sparse])
    )
    vm_job = new_job(env, vm_id, big)
    before_dirs = sorted(p.name for p in root.iterdir())
    refused = rlfleet(env, "job", "pull", str(vm_job), str(root / "big"), "--max-size", "1M")
    assert_one_line(refused, 1, "max-size")
    assert sorted(p.name for p in root.iterdir()) == before_dirs
    assert_one_line(rlfleet(env, "job", "pull", str(vm_job), str(root / "big"), "--max-size",
                            "12X"), 2, "is not a size")  # fmt: skip
    (root / "link-dest").symlink_to(operator)  # DEST may be an empty directory, not a link
    assert_one_line(rlfleet(env, "job", "pull", str(vm_job), str(root / "link-dest")), 2,
                    "exists and is not an empty directory")  # fmt: skip
    assert_untouched(operator)


async def test_a_job_without_a_store_cannot_write_outside_dest_through_job_pull(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    env: dict[str, str],
    transport: Transport,
    tmp_path: Path,
) -> None:
    if not bash_reads_bashrc():
        pytest.skip("the VM account's shell is not bash: ~/.bashrc is not what it reads")
    fleet = sshd_fleet(1)
    ids = await fleet.register(db)
    add_polled_vm(env, "gpu-1", 1)  # `job submit` wants a VM the job could run on
    vm = fleet[0]
    root = tmp_path / "puller"
    root.mkdir()
    await vm_pull_escape_proof(env, SharedAccountJob(transport, vm), ids[vm.name], root)


_JOB_WRITES = """
import json, os, sys
from scheduler.store import parse_store_url
from scheduler.store.backend import open_backend

args = json.load(open(os.environ["JOB_PLAN"]))
url, inst, job, plan = args["url"], args["inst"], int(args["job"]), args["plan"]
try:
    store = open_backend(parse_store_url(url), inst, job)
    for key, data in plan.get("put", {}).items():
        store.put_bytes(data.encode(), key)
    for key, size in plan.get("grow", {}).items():
        if hasattr(store, "root"):
            os.truncate(store.root / key, size)  # sparse: a few KiB on disk
        else:
            store.put_bytes(bytes(size), key)
    for key, target in plan.get("link", {}).items():
        (store.root / key).unlink()
        (store.root / key).symlink_to(target)
except Exception as exc:
    print("RESULT " + json.dumps(f"{type(exc).__name__}: {exc}"))
else:
    print("RESULT " + json.dumps("done"))
"""


async def job_writes(job: JobSide, url: str, inst: str, job_id: int, plan: dict) -> str:
    """The job, on its VM, writes into its place in the store with the VM's configuration:
    "done", or the error that stopped it."""
    return str(await job.run(_JOB_WRITES, {"url": url, "inst": inst, "job": job_id,
                                          "plan": plan}))  # fmt: skip


async def job_put(job: JobSide, url: str, inst: str, job_id: int, plan: dict) -> None:
    tried = await job_writes(job, url, inst, job_id, plan)
    assert tried == "done", tried


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reported(env: dict[str, str], job_id: int, manifest: str) -> None:
    """Record `manifest` (the bytes of a final.json) as one the job's attempt reported, as
    the poller does with what the attempt's store status says."""
    digest = _sha(manifest.encode())
    sql(
        env["RLFLEET_DATABASE_URL"],
        "INSERT INTO job_store_records (job_id, attempt, kind, step, digest) VALUES "
        f"({int(job_id)}, 0, 'final', 0, '{digest}') ON CONFLICT DO NOTHING",
    )


async def store_pull_escape_proof(env: dict[str, str], job_side: JobSide, inst: str,
                                  url: str, root: Path) -> None:  # fmt: skip
    """A job with a store (`job_side`: on its VM, as its account) fills its place in the
    store with hostile content: an object far larger than its manifest entry, a manifest
    naming a path outside, a link to the operator's file (a directory store), a total past
    --max-size. Each pull
    is refused in one line before a byte of it is copied, leaving nothing; an honest
    final output still comes."""
    operator = operator_dir(root)
    job = int(json.loads(rlfleet(env, *SUBMIT, "--store", url, "--json").stdout)["id"])
    sums = {"model.bin": _sha(b"w" * 10), "tokenizer.json": _sha(b"{}")}
    manifest = {"files": {"model.bin": 10, "tokenizer.json": 2}, "at": "T", "sha256": sums}
    honest = {"final/model.bin": "w" * 10, "final/tokenizer.json": "{}",
              "final.json": json.dumps(manifest)}  # fmt: skip
    await job_put(job_side, url, inst, job, {"put": honest})
    # Not reported by any attempt of the job: refused before its sizes are even looked at.
    assert_one_line(rlfleet(env, "job", "pull", str(job), str(root / "unreported")), 1,
                    "not one this job's attempts reported")  # fmt: skip
    # A job can make its own attempt report whatever it wrote (its store.json is its own
    # without --job-user; with one, assume it found a way): every manifest below is
    # recorded as the job's, so what stops each case is the puller's own checks of sizes,
    # names and kinds.
    reported(env, job, honest["final.json"])
    assert pulled(env, job, root / "honest")["bytes"] == 12
    cases: list[tuple[dict, str]] = [
        ({"grow": {"final/model.bin": 256 << 20}}, "manifest says 10"),
        ({"put": {"final.json": json.dumps(
            {"files": {"../../../operator/notes.txt": 4}, "at": "T"})}},
         "not in the store"),
    ]  # fmt: skip
    if url.startswith("file://"):
        # A link to the operator's file of the size its manifest says.
        sized = {"files": {"model.bin": len(OPERATOR["notes.txt"]), "tokenizer.json": 2}}
        cases.append(({"put": {"final.json": json.dumps({**sized, "at": "T"})},
                       "link": {"final/model.bin": str(operator / "notes.txt")}},
                      "not a regular file"))  # fmt: skip
    for n, (plan, says) in enumerate(cases):
        await job_put(job_side, url, inst, job, {"put": honest})
        await job_put(job_side, url, inst, job, plan)
        if "final.json" in plan.get("put", {}):
            reported(env, job, plan["put"]["final.json"])
        before = sorted(p.name for p in root.iterdir())
        refused = rlfleet(env, "job", "pull", str(job), str(root / f"case{n}" / "dest"))
        assert_one_line(refused, 1, says)
        assert sorted(p.name for p in root.iterdir() if p.name != f"case{n}") == before
        assert not (root / f"case{n}").exists() or not any((root / f"case{n}").iterdir())
        assert_untouched(operator)
    await job_put(job_side, url, inst, job, {"put": honest})
    refused = rlfleet(env, "job", "pull", str(job), str(root / "small"), "--max-size", "11")
    assert_one_line(refused, 1, "max-size")
    assert not (root / "small").exists()


async def test_a_job_with_a_store_cannot_write_outside_dest_through_job_pull(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    env: dict[str, str],
    transport: Transport,
    s3: S3Server,
    tmp_path: Path,
) -> None:
    fleet = sshd_fleet(1)
    await fleet.register(db)
    add_polled_vm(env, "gpu-1", 1)
    vm = fleet[0]
    s3.aws_files(vm.home)
    inst = await installation(db)
    job = SharedAccountJob(transport, vm)
    for name, url, user_env in (
        ("file", f"file://{tmp_path}/shared-store", env),
        ("s3", f"s3://{s3.bucket}/runs", {**env, **s3.env()}),
    ):
        root = tmp_path / f"puller-{name}"
        root.mkdir()
        await store_pull_escape_proof(user_env, job, inst, url, root)
