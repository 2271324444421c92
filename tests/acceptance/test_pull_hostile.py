"""Issue 29's critical case end to end: a job on an OpenSSH VM account (tests/sshd.py, the
real sshd; the account's shell is bash, as on most VMs) tries to write outside DEST on the
machine that runs `rlfleet job pull`, through the real CLI, real Postgres and, for a job
with a store, a directory store and the real S3 API of tests/s3server.py.

What the job does is done here as the VM account would: files written into that account's
home (its `~/.bashrc`, its output directory) and, for a store, a script run on the VM over
SSH with the VM's python and AWS configuration. The proofs take the VM and the home the job
writes into, so that a `--job-user` variant can run them with the job's own account."""

from __future__ import annotations

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


def outputs(where: Path) -> Path:
    where.mkdir(parents=True)
    (where / "model.safetensors").write_bytes(b"weights" * 1000)
    (where / "adapter").mkdir()
    (where / "adapter" / "adapter_config.json").write_text("{}")
    return where


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


def vm_pull_escape_proof(env: dict[str, str], vm: SshdVM, vm_id: int, job_home: Path,
                         root: Path) -> None:  # fmt: skip
    """A job without a store, whose files are in `job_home` on `vm`, tries to write
    outside DEST through `job pull` (`root` holds the destinations and the operator's
    directory they must not reach):

    1. with nothing but its own output files: links (a link extracted before the chain it
       goes through, an absolute one out), a hard link, a FIFO;
    2. with a `~/.bashrc` that puts a `tar` of its own first on PATH, which prints a
       hostile stream;
    3. with a `~/.bashrc` that redefines `exec` and `/usr/bin/env` (bash runs functions
       before builtins and before absolute paths): no command can avoid its stream;
    4. with a sparse file far past `--max-size`.

    Each pull leaves in DEST only directories and regular files, inside it, and nothing
    outside DEST changes; a refused one leaves nothing."""
    operator = operator_dir(root)
    # 1. Its own output files.
    own = outputs(job_home / "out-own")
    for i in range(8):
        (own / f"s{i}").mkdir()
        (own / f"s{i}" / "up").symlink_to("..")
        (own / f"l{i}").symlink_to(f"s{i}/up/..")
    (own / "escape").symlink_to(operator)
    os.link(own / "model.safetensors", own / "hard")
    os.mkfifo(own / "fifo")
    job = new_job(env, vm_id, own)
    result = pulled(env, job, root / "own")
    assert_untouched(operator)
    assert_plain_tree(root / "own")
    assert result["skipped"] == 19 and "escape" in result["skipped_names"], result
    assert (root / "own" / "adapter" / "adapter_config.json").read_text() == "{}"
    shown = rlfleet(env, "job", "pull", str(job), str(root / "own-text"))
    assert shown.returncode == 0 and "left out: 19 entries" in shown.stdout, shown
    # 2. and 3. Its ~/.bashrc (read by bash for every command sshd runs).
    evil = job_home / ".evil"
    evil.mkdir()
    stream = shlex.quote(str(evil / "stream.tar"))
    (evil / "stream.tar").write_bytes(hostile_stream(operator))
    (evil / "tar").write_text(f"#!/bin/sh\nexec cat {stream}\n")
    (evil / "tar").chmod(0o755)
    job = new_job(env, vm_id, outputs(job_home / "out-rc"))
    bashrc = job_home / ".bashrc"
    rcs = {
        "path": f"PATH={shlex.quote(str(evil))}:$PATH\n",
        "functions": f"exec() {{ cat {stream}; builtin exit 0; }}\n"
        f"/usr/bin/env() {{ cat {stream}; }}\n",
    }
    for case, rc in rcs.items():
        bashrc.write_text(f'echo read >> "$HOME/.bashrc-read"\n{rc}')
        try:
            result = pulled(env, job, root / case)
        finally:
            bashrc.unlink()
        assert_untouched(operator)
        assert_plain_tree(root / case)
        if job_home == vm.home and bash_reads_bashrc():
            assert (vm.home / ".bashrc-read").is_file(), "sshd's bash did not read ~/.bashrc"
        if case == "path":  # tar by absolute path in a clean environment: the real one ran
            assert result["skipped"] == 0 and (root / case / "model.safetensors").is_file()
        if case == "functions" and job_home == vm.home:  # the stream reached the reader
            assert result["skipped"] >= 5 and "l" in result["skipped_names"], result
    # 4. A sparse file far past --max-size: refused, one line, nothing left.
    big = outputs(job_home / "out-big")
    with open(big / "sparse.bin", "wb") as f:
        f.truncate(64 << 20)
    job = new_job(env, vm_id, big)
    before = sorted(p.name for p in root.iterdir())
    refused = rlfleet(env, "job", "pull", str(job), str(root / "big"), "--max-size", "1M")
    assert_one_line(refused, 1, "max-size")
    assert sorted(p.name for p in root.iterdir()) == before
    assert_one_line(rlfleet(env, "job", "pull", str(job), str(root / "big"), "--max-size",
                            "12X"), 2, "is not a size")  # fmt: skip
    (root / "link-dest").symlink_to(operator)  # DEST may be an empty directory, not a link
    assert_one_line(rlfleet(env, "job", "pull", str(job), str(root / "link-dest")), 2,
                    "exists and is not an empty directory")  # fmt: skip
    assert_untouched(operator)


async def test_a_job_without_a_store_cannot_write_outside_dest_through_job_pull(
    sshd_fleet: Callable[..., SshdFleet],  # noqa: F811
    db: Database,
    env: dict[str, str],
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
    vm_pull_escape_proof(env, vm, ids[vm.name], vm.home, root)


_JOB_WRITES = """
import json, os, sys
from scheduler.store import parse_store_url
from scheduler.store.backend import open_backend

url, inst, job, plan = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
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
"""


async def job_writes(transport: Transport, vm: SshdVM, url: str, inst: str, job: int,
                     plan: dict) -> None:  # fmt: skip
    """The job, on its VM, writes into its place in the store with the VM's configuration."""
    script = vm.home / ".job-writes.py"
    script.write_text(_JOB_WRITES)
    args = [sys.executable, str(script), url, inst, str(job), json.dumps(plan)]
    done = await transport.run(vm.target, shlex.join(args), timeout=60)
    assert done.exit_status == 0, done.stderr


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


async def store_pull_escape_proof(env: dict[str, str], transport: Transport, vm: SshdVM,
                                  inst: str, url: str, root: Path) -> None:  # fmt: skip
    """A job with a store, on `vm`, fills its place in the store with hostile content:
    an object far larger than its manifest entry, a manifest naming a path outside, a
    link to the operator's file (a directory store), a total past --max-size. Each pull
    is refused in one line before a byte of it is copied, leaving nothing; an honest
    final output still comes."""
    operator = operator_dir(root)
    job = int(json.loads(rlfleet(env, *SUBMIT, "--store", url, "--json").stdout)["id"])
    sums = {"model.bin": _sha(b"w" * 10), "tokenizer.json": _sha(b"{}")}
    manifest = {"files": {"model.bin": 10, "tokenizer.json": 2}, "at": "T", "sha256": sums}
    honest = {"final/model.bin": "w" * 10, "final/tokenizer.json": "{}",
              "final.json": json.dumps(manifest)}  # fmt: skip
    await job_writes(transport, vm, url, inst, job, {"put": honest})
    # Not reported by any attempt of the job: refused before its sizes are even looked at.
    assert_one_line(rlfleet(env, "job", "pull", str(job), str(root / "unreported")), 1,
                    "not one this job's attempts reported")  # fmt: skip
    # A job can make its own attempt report whatever it wrote (its store.json is its own
    # without --job-user): every manifest below is recorded as the job's, so what stops
    # each case is the puller's own checks of sizes, names and kinds.
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
        await job_writes(transport, vm, url, inst, job, {"put": honest})
        await job_writes(transport, vm, url, inst, job, plan)
        if "final.json" in plan.get("put", {}):
            reported(env, job, plan["put"]["final.json"])
        before = sorted(p.name for p in root.iterdir())
        refused = rlfleet(env, "job", "pull", str(job), str(root / f"case{n}" / "dest"))
        assert_one_line(refused, 1, says)
        assert sorted(p.name for p in root.iterdir() if p.name != f"case{n}") == before
        assert not (root / f"case{n}").exists() or not any((root / f"case{n}").iterdir())
        assert_untouched(operator)
    await job_writes(transport, vm, url, inst, job, {"put": honest})
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
    for name, url, user_env in (
        ("file", f"file://{tmp_path}/shared-store", env),
        ("s3", f"s3://{s3.bucket}/runs", {**env, **s3.env()}),
    ):
        root = tmp_path / f"puller-{name}"
        root.mkdir()
        await store_pull_escape_proof(user_env, transport, vm, inst, url, root)
