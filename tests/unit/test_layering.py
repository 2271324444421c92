"""The layers of the code base, read from its source: the scheduler never depends on the
training package (what both need, the train-grpo argument schema and its exit codes, lives
in `trlspec/`, which imports neither), and no module of `scheduler/`, `training/` or
`trlspec/` grows past 600 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600
SIZED = ("scheduler", "training", "trlspec")


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported(path: Path, *, top_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import in `path`: at the top, or (unless
    `top_only`) anywhere, inside functions included; and any literal name handed to
    `importlib.import_module` or `__import__`."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                yield node.lineno, str(first.value)


def imports_of(packages: tuple[str, ...], forbidden: set[str], **kw: bool) -> list[str]:
    """`path:line: module` for each import, under `packages`, of a top-level package in
    `forbidden`."""
    found = []
    for package in packages:
        for path in sources(package):
            for line, module in imported(path, **kw):
                if module.split(".")[0] in forbidden:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    return found


def test_the_import_reader_sees_lazy_and_dynamic_imports(tmp_path: Path) -> None:
    """The reader the checks below rely on finds an import at the top, one inside a
    function and one by name through importlib."""
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "def f():\n"
        "    from training.args import parse_args\n"
        "    import importlib\n"
        "    return importlib.import_module('training.errors')\n"
    )
    assert [m for _, m in imported(source)] == [
        "os", "training.args", "importlib", "training.errors"
    ]  # fmt: skip
    assert [m for _, m in imported(source, top_only=True)] == ["os"]


def test_the_scheduler_never_imports_the_training_package() -> None:
    """No module of `scheduler/` imports `training`, at the top, lazily inside a function
    or by name: a machine that only schedules needs nothing of it."""
    assert sources("scheduler")
    assert imports_of(("scheduler",), {"training"}) == []


def test_the_training_and_reward_packages_never_import_the_scheduler() -> None:
    assert imports_of(("training", "rewards"), {"scheduler"}) == []


def test_the_shared_schema_imports_neither_side_nor_trl_at_import_time() -> None:
    """`trlspec` imports neither the scheduler nor the training package, and nothing
    heavy (trl, transformers, torch) when it is imported: only its introspection of the
    installed TRL, inside a function, does."""
    assert sources("trlspec")
    assert imports_of(("trlspec",), {"scheduler", "training"}) == []
    heavy = {"trl", "transformers", "torch", "yaml", "datasets", "peft"}
    assert imports_of(("trlspec",), heavy, top_only=True) == []


def test_checking_a_recipe_at_submit_loads_no_training_nor_trl() -> None:
    """Given a fresh interpreter, reading a job file's `train:` with recipe keys (checked
    against the TRL schema) loads neither `training` nor trl, transformers or torch."""
    code = (
        "import json, sys\n"
        "from scheduler.jobspec import recipe_train\n"
        "found, args, _ = recipe_train({'model_name_or_path': 'm', 'beta': 0.1,\n"
        "                               'num_generations': 4}, 'train')\n"
        "assert found == {'model': 'm'}, found\n"
        "assert args == ('--beta', '0.1', '--num_generations', '4'), args\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    loaded = set(__import__("json").loads(out.splitlines()[-1]))
    assert "scheduler" in loaded
    assert not loaded & {"training", "trl", "transformers", "torch"}


@pytest.mark.parametrize("package", SIZED)
def test_no_module_is_over_600_lines(package: str) -> None:
    """Every module of `scheduler/`, `training/` and `trlspec/` is at most 600 lines: one
    that grows past it is split by concern."""
    assert sources(package)
    long = {
        str(path.relative_to(ROOT)): n
        for path in sources(package)
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
