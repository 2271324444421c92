"""`rlfleet job submit --workdir DIR` and the job-file key `workdir:` through the real CLI
(real Postgres and NATS): a workdir is stored once with the job and `job show` names its
digest and size; a hostile or huge workdir is exit 2, one line, and queues nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scheduler.workdir import pack
from tests.acceptance.test_cli_input import SUBMIT, add_polled_vm, assert_one_line, env, rlfleet

__all__ = ["env"]

pytestmark = pytest.mark.slow


def project(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "my_rewards.py").write_text("def fn(prompts, completions, **kw):\n    return []\n")
    (root / "data" / "train.jsonl").write_text('{"prompt": "p"}\n')
    return root


def jobs(env: dict[str, str]) -> list[dict[str, object]]:
    listed = rlfleet(env, "job", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)  # type: ignore[no-any-return]


def test_submit_with_a_workdir_and_show_it(env: dict[str, str], tmp_path: Path) -> None:
    add_polled_vm(env, "gpu-1", 1)
    source = project(tmp_path / "project")
    digest = pack(source).digest
    done = rlfleet(env, *SUBMIT, "--workdir", str(source), "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    job_id = str(json.loads(done.stdout)["id"])
    shown = json.loads(rlfleet(env, "job", "show", job_id, "--json", "--no-progress").stdout)
    assert shown["workdir"] == digest
    assert shown["workdir_size"] == pack(source).size and shown["workdir_files"] == 2
    text = rlfleet(env, "job", "show", job_id, "--no-progress").stdout
    assert f"workdir:          {digest}" in text.splitlines()
    # The same directory named by a job file, relative to the file, from anywhere.
    spec = tmp_path / "specs" / "job.yaml"
    spec.parent.mkdir()
    spec.write_text(
        "workdir: ../project\nroles:\n  trainer:\n    gpus: 1\n    train:\n"
        "      model: m\n      dataset: data/train.jsonl\n      reward_functions: [my_rewards:fn]\n"
    )
    filed = rlfleet(env, "job", "submit", "-f", str(spec), "--json")
    assert filed.returncode == 0, filed.stderr
    other = str(json.loads(filed.stdout)["id"])
    shown = json.loads(rlfleet(env, "job", "show", other, "--json", "--no-progress").stdout)
    assert shown["workdir"] == digest
    refused = rlfleet(env, "job", "submit", "-f", str(spec), "--workdir", str(source))
    assert_one_line(refused, 2, "give workdir in the file, not as well")


@pytest.mark.parametrize("kind", ["symlink-out", "huge", "fifo", "missing"])
def test_a_workdir_that_cannot_ship_is_exit_2_one_line_and_queues_nothing(
    env: dict[str, str], tmp_path: Path, kind: str
) -> None:
    add_polled_vm(env, "gpu-1", 1)
    source = project(tmp_path / "project")
    if kind == "symlink-out":
        (source / "creds").symlink_to(Path.home() / ".ssh" / "id_ed25519")
        message = "creds is a symlink out of the workdir"
    elif kind == "huge":
        with open(source / "data" / "huge.bin", "wb") as handle:
            handle.truncate(3 << 30)  # sparse: costs nothing, reads as 3 GiB
        message = "over the 1024.0 MiB limit; largest: data/huge.bin (3072.0 MiB)"
    elif kind == "fifo":
        os.mkfifo(source / "pipe")
        message = "pipe is not a regular file or directory"
    else:
        source = tmp_path / "nowhere"
        message = "nowhere: not a directory"
    assert_one_line(rlfleet(env, *SUBMIT, "--workdir", str(source)), 2, message)
    assert jobs(env) == []
