"""What the CLI reads of a running `up`'s state dir is refused unless it is what `up`
writes: a FIFO or an oversized file in place of the env file is refused at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler.errors import BadInput
from scheduler.upfind import MAX_ENV_FILE_BYTES, lock_is_held, read_private_env_file


@pytest.mark.timeout(10)
def test_a_fifo_in_place_of_the_env_file_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "env"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(BadInput, match="not a regular file"):
        read_private_env_file(fifo)


@pytest.mark.timeout(10)
def test_a_fifo_in_place_of_the_lock_is_no_lock_held(tmp_path: Path) -> None:
    fifo = tmp_path / "up.lock"
    os.mkfifo(fifo, 0o600)
    assert lock_is_held(fifo) is False


def test_an_env_file_larger_than_up_writes_is_refused(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.write_text("export A=b\n" * (MAX_ENV_FILE_BYTES // 10))
    env.chmod(0o600)
    with pytest.raises(BadInput, match="larger than"):
        read_private_env_file(env)


def test_a_private_env_file_is_read(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.write_text("export RLFLEET_DATABASE_URL='postgresql://x@h/d'\n")
    env.chmod(0o600)
    assert read_private_env_file(env) == {"RLFLEET_DATABASE_URL": "postgresql://x@h/d"}
