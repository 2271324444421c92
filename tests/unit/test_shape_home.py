"""A job's shape has one home: `scheduler/attempts/` reads a stored job's `roles`
(`JobShape.of_row`) and `scheduler/jobspec/` parses a spec file; every other module asks the
shape (`claim.shape`, `JobShape.of_row(row)`, `JobShape.of_spec(spec)`), never
`parse_data` again (issue 30, point 1)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import scheduler

ROOT = Path(scheduler.__file__).parent

HOMES = ("attempts/", "jobspec/")
"""Where roles are parsed: a stored row's (`attempts/shape.py`), a file's (`jobspec/`)."""

ALLOWED = {
    # `job submit` reads the user's FILE (or the flags' group) into a spec: jobspec's job,
    # done where the CLI builds the job, before any row exists.
    "cli/jobfile.py",
}


def parse_data_callers() -> set[str]:
    """Every module of `scheduler/` (relative path) that calls `parse_data`, by any name
    it is reached through (`parse_data(...)`, `jobspec.parse_data(...)`)."""
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "parse_data":
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_only_the_shape_and_the_spec_reader_parse_roles() -> None:
    """Given every module of the scheduler, when the calls of `parse_data` are listed,
    then none is outside `attempts/` and `jobspec/` but the allowed ones."""
    outside = {m for m in parse_data_callers() if not m.startswith(HOMES)}
    assert outside - ALLOWED == set(), "parse roles through attempts.shape.JobShape instead"


def test_the_walk_finds_the_callers_it_must() -> None:
    """The walk is not blind: it finds the shape's own call, and an allowed caller."""
    callers = parse_data_callers()
    assert "attempts/shape.py" in callers
    assert "cli/jobfile.py" in callers


# -- `gpus_requested` has one meaning: every GPU of an attempt ------------------------------


def test_a_training_row_holds_every_gpu_of_its_attempt_shared_evenly_by_its_vms() -> None:
    """Given a training row of 3 VMs with gpus_requested 6 (every GPU of the attempt),
    its shape has 2 GPUs on each VM; the same total on one VM is 6 there."""
    from scheduler.attempts.shape import JobShape

    shape = JobShape.of(3, None, 6)
    assert shape.demands == (2, 2, 2) and shape.gpus == 6 and shape.problem is None
    assert JobShape.of(1, None, 6).demands == (6,)


def test_a_training_row_whose_gpus_do_not_divide_says_why() -> None:
    """A row edited by hand whose total is not the same on each VM cannot launch."""
    from scheduler.attempts.shape import JobShape

    shape = JobShape.of(2, None, 3)
    assert shape.problem == "gpus_requested 3 is not the same GPUs on each of 2 VMs"
    assert shape.nodes == 2


def test_a_multi_node_total_beyond_one_vms_limit_is_allowed() -> None:
    """64 VMs of 8 GPUs: 512 together, and the largest job, 1024 on each of 64 VMs."""
    from scheduler.attempts.shape import JobShape
    from scheduler.validate import MAX_GPUS, MAX_JOB_GPUS, MAX_NODES

    assert JobShape.of(64, None, 512).demands == (8,) * 64
    assert JobShape.of(MAX_NODES, None, MAX_JOB_GPUS).demands == (MAX_GPUS,) * MAX_NODES
    assert JobShape.of(1, None, MAX_GPUS + 1).problem == (
        f"gpus_requested {MAX_GPUS + 1} is more than {MAX_GPUS} GPUs on a VM"
    )


def test_the_shape_of_a_spec_about_to_be_submitted() -> None:
    """`--gpus` stays GPUs on each VM on the command line: the spec's shape has them on
    each of its `--nodes`; a group's comes from its roles."""
    from scheduler.attempts.shape import JobShape
    from scheduler.jobspec import GroupSpec, Role
    from scheduler.jobstore import JobSpec

    assert JobShape.of_spec(JobSpec("m", "d", ("r",), gpus=4, nodes=2)).demands == (4, 4)
    roles = GroupSpec(
        roles=(Role("t", 2, 2, command=("x",), primary=True), Role("s", 1, command=("y",)))
    ).to_data()
    shape = JobShape.of_spec(JobSpec("m", "d", ("r",), gpus=5, nodes=2, roles=roles))
    assert shape.group and shape.demands == (3, 2)


# -- a new kind of job is one module --------------------------------------------------------

KIND_BRANCH = re.compile(
    r"roles is (not )?None|\bnodes (==|!=|>|<=|<) 1\b|\bgroup is (not )?None|"
    r"\bif [^:]*\.group\b(?!\()|shape\.group\b|\.multi_node\b|JobKind\."
)
"""What deciding by the kind of job looks like in code (a regex's `.group(...)` aside)."""


def kind_branches(source: str) -> list[str]:
    """The lines of `source` that branch on the kind of job."""
    return [line.strip() for line in source.splitlines() if KIND_BRANCH.search(line)]


def test_every_kind_of_job_has_one_planning_module() -> None:
    """Given every `JobKind`, the launch finds the module that plans it, with the same
    function each (`Kind.plan`), from the shape alone."""
    from scheduler.attempts.kinds import KINDS, group, kind_of, training
    from scheduler.attempts.shape import JobKind, JobShape

    assert set(KINDS) == set(JobKind)
    assert all(inspect.iscoroutinefunction(module.plan) for module in KINDS.values())
    params = {tuple(inspect.signature(m.plan).parameters) for m in KINDS.values()}
    assert len(params) == 1
    assert kind_of(JobShape.training(2, 3)) is training
    spread = {"roles": {"t": {"command": ["x"], "gpus": 1, "nodes": 2, "primary": True}}}
    assert kind_of(JobShape.of(2, spread, 2)) is group


def test_the_launch_never_branches_on_the_kind_of_job() -> None:
    """`dispatcher/launch.py` starts every kind through the same loop: what differs is
    planned by the kind's module, so the launcher has no line that asks what kind a job
    is (it did: `if claim.roles is None:` before a training job's plan)."""
    source = (ROOT / "dispatcher" / "launch.py").read_text(encoding="utf-8")
    assert kind_branches(source) == []
    assert kind_branches("        if claim.roles is None:\n") != []  # the check can fail
    assert kind_branches("    found.group(1)\n") == []
