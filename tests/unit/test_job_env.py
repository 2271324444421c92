"""`job submit --env`: which names a job may set, and how the VM's env files are read
(read, never run as shell code)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from scheduler.claims.result import job_env_pairs
from scheduler.cli.jobfile import parse_env_options
from scheduler.errors import BadInput
from scheduler.jobs import JobSpec
from scheduler.remote.env import clean_env_words, job_env_text, load_env_lines


def spec(*env: tuple[str, str]) -> JobSpec:
    """A valid job spec with these `--env` pairs."""
    return JobSpec(model="m", dataset="d", reward_functions=("r",), env=tuple(env))


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ((("HF_TOKEN", "x"),), None),
        ((("_private1", ""),), None),
        ((("1ABC", "x"),), "not a variable name"),
        ((("A-B", "x"),), "not a variable name"),
        ((("", "x"),), "not a variable name"),
        ((("RLFLEET_DATABASE_URL", "x"),), "set by the scheduler"),
        ((("RLFLEET_ANYTHING", "x"),), "set by the scheduler"),
        ((("CUDA_VISIBLE_DEVICES", "0"),), "set by the scheduler"),
        ((("A", "x"), ("A", "y")), "given twice"),
        ((("A", "line1\nline2"),), "one line"),
        ((("A", "nul\0"),), "one line"),
    ],
)
def test_env_keys_must_be_identifiers_and_not_the_schedulers(
    env: tuple[tuple[str, str], ...], problem: str | None
) -> None:
    if problem is None:
        spec(*env).validate()
        return
    with pytest.raises(BadInput, match=problem):
        spec(*env).validate()


def test_env_option_takes_key_value_or_the_value_of_this_shell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FROM_SHELL", "s=1")
    assert parse_env_options(("A=b=c", "FROM_SHELL", "E=")) == (
        ("A", "b=c"),
        ("FROM_SHELL", "s=1"),
        ("E", ""),
    )
    monkeypatch.delenv("FROM_SHELL")
    with pytest.raises(BadInput, match="not set in this shell"):
        parse_env_options(("FROM_SHELL",))


def test_a_hand_written_env_row_is_filtered_not_trusted() -> None:
    row = {"OK": "1", "RLFLEET_X": "2", "bad key": "3", "N": 4, "NL": "a\nb"}
    assert job_env_pairs(row) == (("OK", "1"),)
    assert job_env_pairs(["not", "a", "dict"]) == ()


def run_loader(tmp_path: Path, text: str) -> dict[str, str]:
    """Load `text` as an env file in a clean `sh`, return what it exported."""
    env_file = tmp_path / "env"
    env_file.write_text(text)
    script = "\n".join([*load_env_lines([str(env_file)]), "env"])
    out = subprocess.run(
        ["/bin/sh", "-c", script], env={"PATH": os.environ["PATH"]}, cwd=tmp_path,
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_env_file_lines_are_read_never_run(tmp_path: Path) -> None:
    exported = run_loader(
        tmp_path,
        "# comment\n"
        "\n"
        'export HF_TOKEN="hf abc"\n'
        "SINGLE='x y'\n"
        "SUBST=$(touch pwned) `touch pwned2` $HOME;\n"
        "EQUALS=a=b\n"
        "bad-key=1\n"
        "1X=2\n"
        "NOEQUALS\n"
        "CUDA_VISIBLE_DEVICES=7\n"
        "RLFLEET_JOB_ID=99\n"
        "LAST=no-newline",
    )
    assert exported["HF_TOKEN"] == "hf abc"
    assert exported["SINGLE"] == "x y"
    assert exported["SUBST"] == "$(touch pwned) `touch pwned2` $HOME;"
    assert exported["EQUALS"] == "a=b"
    assert exported["LAST"] == "no-newline"
    for skipped in ("bad-key", "1X", "NOEQUALS", "CUDA_VISIBLE_DEVICES", "RLFLEET_JOB_ID"):
        assert skipped not in exported
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


def test_job_env_file_round_trips_through_the_loader(tmp_path: Path) -> None:
    pairs = (("A", "1 2 $X"), ("B", "'quoted inside' and \"more\"x"), ("C", "'q'"), ("D", '"d"'))
    exported = run_loader(tmp_path, job_env_text(pairs))
    assert [(key, exported[key]) for key, _ in pairs] == list(pairs)


def test_clean_env_keeps_only_the_listed_names() -> None:
    out = subprocess.run(
        ["/bin/sh", "-c", f"{clean_env_words()} env"],
        env={"PATH": "/usr/bin:/bin", "HOME": "/h", "SECRET": "s", "LANG": "C.UTF-8"},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert sorted(out.splitlines()) == ["HOME=/h", "LANG=C.UTF-8", "PATH=/usr/bin:/bin"]
