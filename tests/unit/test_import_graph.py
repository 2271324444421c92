"""No import cycle between the command line and the engines: an engine never loads
`scheduler.cli` (or click), and the CLI loads an engine, SSH, NATS or Prometheus only when
a command that needs them runs."""

from __future__ import annotations

import json
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


def test_the_commands_defaults_are_the_engines_defaults() -> None:
    """The defaults the daemon commands repeat (so as not to import the engines) are the
    engines' own."""
    import inspect

    from scheduler import claims, cli, dispatcher, gpu_poller, models
    from scheduler.cli import daemons

    knobs = inspect.signature(dispatcher.GlobalJobDispatcher.__init__).parameters
    assert daemons.CLAIM_LEASE_S == claims.DEFAULT_LEASE_S
    assert knobs["launch_timeout_s"].default == daemons.LAUNCH_TIMEOUT_S
    assert knobs["max_in_flight"].default == daemons.MAX_IN_FLIGHT
    assert daemons.ENTRYPOINT == models.DEFAULT_ENTRYPOINT
    assert gpu_poller.DEFAULT_UNREACHABLE_AFTER == daemons.UNREACHABLE_AFTER_POLLS
    assert cli.cli.get_command(None, "poller") is daemons.poller  # type: ignore[arg-type]
