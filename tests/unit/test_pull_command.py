"""What `job pull` runs on a VM without a store (`scheduler/remote/pull.py`): the real tar
by absolute path in a clean environment, whatever PATH or variables the account's shell
was given (a job can set them through the VM's `~/.rlfleet/env`, a profile, its own
files). A startup file that redefines the shell's commands is beyond any command's reach:
`scheduler/untar.py` trusts nothing of the stream, docs/security.md."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

from scheduler.remote.pull import tar_command


def run(command: str, home: Path, path: str) -> subprocess.CompletedProcess[bytes]:
    env = {"HOME": str(home), "PATH": path, "TAR_OPTIONS": "--to-stdout", "LD_PRELOAD": ""}
    return subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True, timeout=30)


def test_the_real_tar_runs_in_a_clean_environment_whatever_path_says(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = home / "out dir"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (out / "model.bin").write_bytes(b"weights")
    hostile = tmp_path / "bin"
    hostile.mkdir()
    (hostile / "tar").write_text('#!/bin/sh\necho hostile > "$HOME/ran"\nexit 0\n')
    (hostile / "tar").chmod(0o755)
    (hostile / "env").write_text('#!/bin/sh\necho hostile > "$HOME/ran"\nexit 0\n')
    (hostile / "env").chmod(0o755)
    done = run(tar_command("out dir", None), home, f"{hostile}:/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert not (home / "ran").exists()
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        names = sorted(m.name for m in tar)
    assert names == [".", "./model.bin"]
    one = run(tar_command("out dir", 3), home, f"{hostile}:/usr/bin:/bin")
    with tarfile.open(fileobj=io.BytesIO(one.stdout)) as tar:
        assert sorted(m.name for m in tar) == [".", "./trainer_state.json"]
    missing = run(tar_command("nowhere", None), home, os.defpath)
    assert missing.returncode == 3 and b"no such directory on this VM" in missing.stderr
