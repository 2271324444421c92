"""A job's workdir: packing where the CLI runs (ignores, determinism, modes, limits,
hostile trees) and unpacking on a VM (the receiver refuses every path escape)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from scheduler import workdir as wd
from scheduler.errors import BadInput
from scheduler.remote.launch import LaunchSpec, launch_script, wrapper_script
from scheduler.remote.layout import Attempt
from scheduler.remote.workdir import (
    RECEIVE_CODE,
    cache_dir,
    check_digest,
    has_script,
    parse_has,
    parse_ready,
    receive_script,
)

INSTALLATION = "0b8f1c2e-1111-4222-8333-944455556666"


def tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)
    return root


def members(packed: wd.PackedWorkdir) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def test_packing_is_deterministic_and_content_addressed(tmp_path: Path) -> None:
    """Given the same files, packing twice (mtimes changed in between) gives the same bytes,
    whose sha256 is the digest; a changed file changes it."""
    root = tree(tmp_path / "w", {"my_rewards.py": "def fn(**k): return []\n", "data/a.jsonl": "{}"})
    first = wd.pack(root)
    os.utime(root / "my_rewards.py", (1, 1))
    second = wd.pack(root)
    assert first.data == second.data
    assert first.digest == hashlib.sha256(first.data).hexdigest() == second.digest
    assert first.files == 2 and first.size == len(first.data)
    (root / "data/a.jsonl").write_text("{ }")
    assert wd.pack(root).digest != first.digest


def test_modes_are_kept_and_owners_and_times_dropped(tmp_path: Path) -> None:
    root = tree(tmp_path / "w", {"run.sh": "#!/bin/sh\n", "ro.txt": "x"})
    (root / "run.sh").chmod(0o755)
    (root / "ro.txt").chmod(0o444)
    found = members(wd.pack(root))
    assert stat.S_IMODE(found["run.sh"].mode) == 0o755
    assert stat.S_IMODE(found["ro.txt"].mode) == 0o444
    assert {(m.uid, m.gid, m.uname, m.mtime) for m in found.values()} == {(0, 0, "", 0)}


def test_default_ignores_and_rlfleetignore(tmp_path: Path) -> None:
    """.git, __pycache__, .venv and *.pyc are left out by default; .rlfleetignore adds
    gitignore-style patterns (anchored, directory-only, negation, **)."""
    root = tree(
        tmp_path / "w",
        {
            ".git/config": "x",
            "pkg/__pycache__/m.cpython-311.pyc": "x",
            "pkg/m.pyc": "x",
            ".venv/bin/python": "x",
            "pkg/m.py": "x",
            "data/train.jsonl": "x",
            "data/big.bin": "x",
            "data/keep.bin": "x",
            "build/out.o": "x",
            "src/build/kept.txt": "x",
            "a/b/tmp/t": "x",
            "notes.log": "x",
            ".rlfleetignore": "# comment\n*.bin\n!data/keep.bin\n/build/\n**/tmp\n*.log\n",
        },
    )
    names = set(members(wd.pack(root)))
    assert names == {
        ".rlfleetignore",
        "a",
        "a/b",
        "data",
        "data/keep.bin",
        "data/train.jsonl",
        "pkg",
        "pkg/m.py",
        "src",
        "src/build",
        "src/build/kept.txt",
    }


@pytest.mark.parametrize(
    ("pattern", "path", "is_dir", "expected"),
    [
        ("*.txt", "a/b/c.txt", False, True),
        ("/c.txt", "a/c.txt", False, False),
        ("/c.txt", "c.txt", False, True),
        ("a/*.txt", "a/b/c.txt", False, False),
        ("a/**/c.txt", "a/b/x/c.txt", False, True),
        ("logs/", "logs", False, False),
        ("logs/", "x/logs", True, True),
        ("f?o", "foo", False, True),
        ("[ab].py", "b.py", False, True),
        ("[!ab].py", "b.py", False, False),
    ],
)
def test_ignore_patterns(pattern: str, path: str, is_dir: bool, expected: bool) -> None:
    assert wd.ignored(wd.parse_ignore([pattern]), path, is_dir) is expected


def test_a_symlink_out_of_the_workdir_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("no")
    root = tree(tmp_path / "w", {"ok.py": "x"})
    (root / "leak").symlink_to(secret)
    with pytest.raises(BadInput, match=r"leak is a symlink out of the workdir"):
        wd.pack(root)
    (root / ".rlfleetignore").write_text("leak\n")
    assert "leak" not in members(wd.pack(root))  # ignored: not even looked at


def test_a_symlink_to_a_file_inside_is_packed_as_a_copy(tmp_path: Path) -> None:
    root = tree(tmp_path / "w", {"data/real.jsonl": "{}\n"})
    (root / "alias.jsonl").symlink_to("data/real.jsonl")
    found = members(wd.pack(root))
    assert found["alias.jsonl"].isreg() and found["alias.jsonl"].size == 3


@pytest.mark.parametrize("kind", ["dir", "dangling", "parent"])
def test_other_symlinks_are_refused(tmp_path: Path, kind: str) -> None:
    root = tree(tmp_path / "w", {"sub/x.py": "x"})
    target = {"dir": "sub", "dangling": "nowhere", "parent": ".."}[kind]
    (root / "link").symlink_to(target)
    with pytest.raises(BadInput, match="link is a"):
        wd.pack(root)


def test_a_fifo_is_refused(tmp_path: Path) -> None:
    root = tree(tmp_path / "w", {"x.py": "x"})
    os.mkfifo(root / "pipe")
    with pytest.raises(BadInput, match="pipe is not a regular file or directory"):
        wd.pack(root)


def test_a_workdir_over_the_packed_limit_names_its_largest_files(tmp_path: Path) -> None:
    root = tree(
        tmp_path / "w",
        {"big.bin": os.urandom(300_000), "mid.bin": os.urandom(200_000), "small.py": "x"},
    )
    with pytest.raises(BadInput) as caught:
        wd.pack_entries(wd.scan(root), "--workdir w", limit=100_000)
    message = str(caught.value)
    assert "\n" not in message
    assert "packs to more than" in message
    assert message.index("big.bin") < message.index("mid.bin")
    assert ".rlfleetignore" in message


def test_a_workdir_over_the_unpacked_limit_is_refused_before_packing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wd, "WORKDIR_MAX_UNPACKED", 1000)
    root = tree(tmp_path / "w", {"data/huge.jsonl": "x" * 5000})
    with pytest.raises(BadInput, match=r"over the .* limit; largest: data/huge.jsonl"):
        wd.scan(root)


def test_too_many_files_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wd, "WORKDIR_MAX_FILES", 3)
    root = tree(tmp_path / "w", {f"f{i}": "x" for i in range(5)})
    with pytest.raises(BadInput, match="more than 3 files"):
        wd.scan(root)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="not a directory"):
        wd.pack(tmp_path / "missing")


# -- the VM side ---------------------------------------------------------------------------


def receive(
    data: bytes, final: Path, digest: str | None = None, max_bytes: int = 1 << 30
) -> subprocess.CompletedProcess[str]:
    """Run the receiver as a VM does: base64 on stdin."""
    return subprocess.run(
        [sys.executable, "-c", RECEIVE_CODE, str(final),
         digest or hashlib.sha256(data).hexdigest(), str(max_bytes), "1000"],
        input=base64.b64encode(data).decode(),
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def crafted(*entries: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, content in entries:
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return buffer.getvalue()


def info(
    name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.size, member.linkname = kind, size, link
    return member


def test_the_receiver_unpacks_with_modes_and_appears_whole(tmp_path: Path) -> None:
    root = tree(tmp_path / "w", {"run.sh": "#!/bin/sh\n", "data/a.jsonl": "{}"})
    (root / "run.sh").chmod(0o750)
    packed = wd.pack(root)
    final = tmp_path / "cache" / packed.digest
    done = receive(packed.data, final)
    assert done.returncode == 0, done.stderr
    assert parse_ready(done.stdout)
    assert (final / "data/a.jsonl").read_text() == "{}"
    assert stat.S_IMODE((final / "run.sh").stat().st_mode) == 0o750
    assert sorted(p.name for p in final.parent.iterdir()) == [packed.digest]  # no temp left
    again = receive(packed.data, final)  # already there: nothing is written again
    assert again.returncode == 0 and parse_ready(again.stdout)


@pytest.mark.parametrize(
    "hostile",
    [
        [(info("../escape.txt", size=2), b"hi")],
        [(info("/tmp/abs.txt", size=2), b"hi")],
        [(info("a/../../escape.txt", size=2), b"hi")],
        [(info("link", tarfile.SYMTYPE, link="/etc"), None)],
        [(info("link", tarfile.SYMTYPE, link="inside.txt"), None)],
        [(info("in.txt", size=2), b"hi"), (info("hard", tarfile.LNKTYPE, link="/etc/x"), None)],
        [(info("dev", tarfile.CHRTYPE), None)],
        [(info("fifo", tarfile.FIFOTYPE), None)],
        [(info("big", size=5000), b"x" * 5000)],
    ],
    ids=["dotdot", "absolute", "dotdot-inside", "symlink-out", "symlink-in", "hardlink",
         "device", "fifo", "bomb"],
)  # fmt: skip
def test_the_receiver_refuses_hostile_tars_and_leaves_nothing(
    tmp_path: Path, hostile: list[tuple[tarfile.TarInfo, bytes | None]]
) -> None:
    data = crafted(*hostile)
    final = tmp_path / "cache" / hashlib.sha256(data).hexdigest()
    done = receive(data, final, max_bytes=1000)
    assert done.returncode != 0
    assert "rlfleet: workdir refused" in done.stderr.strip().splitlines()[-1]
    assert not parse_ready(done.stdout)
    assert list(final.parent.iterdir()) == []
    assert not (tmp_path / "escape.txt").exists()


def test_the_receiver_removes_what_an_earlier_one_left_half_done(tmp_path: Path) -> None:
    """A half-unpacked directory a killed receiver left is removed by the next receiver
    once it is a day old; a younger one (perhaps a receiver at work) is left alone."""
    packed = wd.pack(tree(tmp_path / "w", {"a": "x"}))
    cache = tmp_path / "cache"
    old, young = cache / ".tmp-dead-0001", cache / ".tmp-busy-0002"
    for folder in (old, young):
        (folder / "sub").mkdir(parents=True)
    os.utime(old, (0, time.time() - 2 * 86400))
    done = receive(packed.data, cache / packed.digest)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in cache.iterdir()) == sorted([young.name, packed.digest])


def test_the_receiver_refuses_bytes_that_are_not_the_digest(tmp_path: Path) -> None:
    packed = wd.pack(tree(tmp_path / "w", {"a": "x"}))
    final = tmp_path / "cache" / packed.digest
    done = receive(packed.data + b"\0", final, digest=packed.digest)
    assert done.returncode != 0 and "sha256" in done.stderr
    assert not final.exists()


def test_scripts_quote_and_check_every_word() -> None:
    digest = "a" * 64
    assert cache_dir(INSTALLATION, digest).endswith(f"/workdirs/{digest}")
    for bad in ("A" * 64, "a" * 63, "../" + "a" * 61, "a" * 64 + "\n"):
        with pytest.raises(ValueError):
            check_digest(bad)
    assert parse_has(has_script(INSTALLATION, digest)) is None
    assert parse_has("rlfleet-workdir-present\n") is True
    assert parse_has("rlfleet-workdir-missing\n") is False
    script = receive_script("/opt/py thon; rm -rf ~", INSTALLATION, digest)
    assert script.startswith("'/opt/py thon; rm -rf ~' -I -c '")  # isolated


def spec(workdir: str | None) -> LaunchSpec:
    return LaunchSpec(
        run=Attempt(INSTALLATION, 7, 2, "0123456789abcdef"),
        python="python3",
        entrypoint="training.train_grpo",
        gpu_indices=[0],
        model="m",
        dataset="data/train.jsonl",
        reward_functions=("my_rewards:fn",),
        output_dir="~/out",
        workdir=workdir,
    )


def test_an_attempt_with_a_workdir_runs_in_its_own_copy() -> None:
    digest = "b" * 64
    wrapper = wrapper_script(spec(digest))
    assert 'cd "$d/work" || exit 1' in wrapper
    assert 'export RLFLEET_WORKDIR="$d/work"' in wrapper
    assert 'export PYTHONPATH="$RLFLEET_WORKDIR${PYTHONPATH:+:$PYTHONPATH}"' in wrapper
    # PYTHONPATH is set after the env files, so that neither can drop the workdir.
    assert wrapper.index("PYTHONPATH=") > wrapper.rindex("rlfleet_f in")
    launch = launch_script(spec(digest))
    assert f'cp -R -p "$HOME"/.rlfleet/{INSTALLATION}/workdirs/{digest} "$d/work"' in launch
    plain = wrapper_script(spec(None))
    assert 'cd "$HOME" || exit 1' in plain and "RLFLEET_WORKDIR=" not in plain
    assert "workdirs" not in launch_script(spec(None))
