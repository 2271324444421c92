"""The chaos test's witnesses on multi-node jobs: the ranks of one attempt running together
are one run of the job, while anything else alive at once is still a duplicate; and the
stand-in training fails on the rank it is told to only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.acceptance.chaos import Run, duplicate_runs
from tests.workloads import fake_train


def run(job: int, attempt: int, rank: int, vm: str, start: float, end: float) -> Run:
    """A run of one rank of `job`, holding GPU 0 of `vm`."""
    return Run(vm, job, attempt, ("GPU-0",), 100 + rank, start, end, rank)


def test_the_ranks_of_one_attempt_together_are_no_duplicate() -> None:
    """Rank 0 and rank 1 of attempt 1, alive at once on two VMs, are one run of the job."""
    assert duplicate_runs([run(1, 1, 0, "vm0", 0, 10), run(1, 1, 1, "vm1", 0, 10)]) == []


def test_a_rank_alive_twice_or_beside_another_attempt_is_a_duplicate() -> None:
    """One rank of an attempt alive twice, or a rank of attempt 1 outliving its attempt
    into attempt 2 (another rank, another VM), are duplicates, as for single-node jobs."""
    twice = [run(1, 1, 0, "vm0", 0, 10), run(1, 1, 0, "vm1", 5, 15)]
    assert len(duplicate_runs(twice)) == 1
    outlived = [run(1, 1, 0, "vm0", 0, 10), run(1, 2, 1, "vm2", 8, 12)]
    assert duplicate_runs(outlived) == ["job 1: attempt 1 rank 0 on vm0 and 2 rank 1 on vm2"]
    assert duplicate_runs([run(1, 1, 0, "vm0", 0, 10), run(1, 2, 0, "vm1", 10, 12)]) == []


@pytest.mark.parametrize(("rank", "code"), [("0", 0), ("1", 64)])
def test_fake_fail_rank_fails_only_that_rank(
    rank: str, code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--fake_exit 64 --fake_fail_rank 1`: rank 1 exits 64, rank 0 trains and exits 0."""
    monkeypatch.setenv("RLFLEET_NODE_RANK", rank)
    monkeypatch.setenv("RLFLEET_FAKE_RECORD", str(tmp_path))
    monkeypatch.setenv("RLFLEET_SIM_VM", "vm0")
    argv = ["--output_dir", str(tmp_path / "out"), "--fake_exit", "64", "--fake_fail_rank", "1"]
    assert fake_train.main(argv) == code
    lines = [json.loads(ln) for f in tmp_path.glob("*.jsonl") for ln in f.read_text().splitlines()]
    assert [(r["event"], r["node_rank"]) for r in lines] == [("start", rank), ("end", rank)]


def test_fake_oom_once_on_one_rank_leaves_the_others_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--fake_oom_once --fake_fail_rank 1` on shared storage: rank 0 never runs out of
    memory, rank 1 does on the first attempt only."""
    argv = ["--output_dir", str(tmp_path), "--fake_oom_once", "--fake_fail_rank", "1"]
    monkeypatch.setenv("RLFLEET_NODE_RANK", "0")
    assert fake_train.main(argv) == 0
    monkeypatch.setenv("RLFLEET_NODE_RANK", "1")
    assert fake_train.main(argv) == 75
    assert fake_train.main(argv) == 0
