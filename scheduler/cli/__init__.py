"""The `rlfleet` command line. Thin: it parses, calls the same functions the daemons
use, and prints. Errors are one line on stderr: exit 2 for bad input, 1 for a service
that cannot be reached."""

from __future__ import annotations

import importlib
import sys

import click

from scheduler import __version__
from scheduler.cli._common import (
    CliContext,
    database_url_option,
    log_level_option,
    nats_url_option,
    run_guarded,
)

COMMANDS: dict[str, tuple[str, str]] = {
    "db": ("scheduler.cli.db:group", "Create or upgrade the database schema (Alembic migrations)."),
    "vm": ("scheduler.cli.vm:group", "Register, inspect, drain and remove VMs."),
    "job": ("scheduler.cli.job:group", "Submit, list, inspect, follow, cancel and retry jobs."),
    "web": (
        "scheduler.cli.web:web",
        "Serve the web dashboard and its JSON API (/api/…, as the CLI's --json).",
    ),
    "up": (
        "scheduler.cli.daemons:up",
        "Run everything on this machine: embedded Postgres and NATS, the three daemons.",
    ),
    "poller": (
        "scheduler.cli.daemons:poller",
        "Poll the VMs' GPUs and launched jobs over SSH (the GPU poller; several share the VMs).",
    ),
    "dispatcher": (
        "scheduler.cli.daemons:dispatcher",
        "Run the dispatcher: claim GPUs for new jobs and launch them over SSH.",
    ),
    "requeue": (
        "scheduler.cli.daemons:requeue",
        "Run the requeue manager: retries, stuck jobs, lost VMs, unannounced jobs.",
    ),
}
"""Every subcommand: where it is defined, and its one-line help for `rlfleet --help`
(tests/unit/test_import_graph.py checks the line is the command's own)."""


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that command runs, so that
    `rlfleet --help` and each command load only what they use (a few hundredths of a
    second, not a second of SQLAlchemy, SSH, NATS and Prometheus)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """The subcommands, sorted."""
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import the subcommand `cmd_name`; None when there is no such command."""
        if cmd_name not in COMMANDS:
            return None
        module, _, name = COMMANDS[cmd_name][0].partition(":")
        command = getattr(importlib.import_module(module), name)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of `--help`, as click writes it, from `COMMANDS`: no subcommand
        is imported."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        # A stand-in command with the same help shortens it exactly as click would.
        rows = [
            (name, click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit))
            for name in names
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@database_url_option("SQLAlchemy URL of the Postgres database (env RLFLEET_DATABASE_URL).")
@nats_url_option("NATS server(s), comma-separated (env RLFLEET_NATS_URL).")
@log_level_option(
    "Log verbosity, logs go to stderr (default: WARNING for commands, INFO for daemons)."
)
@click.version_option(__version__, prog_name="rlfleet")
@click.pass_context
def cli(
    ctx: click.Context, database_url: str | None, nats_url: str | None, log_level: str | None
) -> None:
    """rlfleet schedules GRPO training jobs on your own GPU machines.

    Postgres holds the truth, NATS carries the "there is work" signal, SSH reaches the
    VMs. Start with `rlfleet up` on one machine, or `rlfleet db upgrade` and the three
    daemons (poller, dispatcher, requeue) on a real fleet.
    """
    # The URLs are checked where they are used (`CliContext.run`), so that `--help` works
    # whatever the environment says.
    level = log_level.upper() if log_level else None
    ctx.obj = CliContext(database_url, nats_url, level)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    sys.exit(run_guarded(cli, argv))
