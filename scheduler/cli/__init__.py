"""The `rlfleet` command line. Thin: it parses, calls the same functions the daemons
use, and prints. Errors are one line on stderr: exit 2 for bad input, 1 for a service
that cannot be reached."""

from __future__ import annotations

import sys

import click

from scheduler import __version__
from scheduler.cli._common import CliContext, run_guarded
from scheduler.settings import Settings


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--database-url",
    envvar="RLFLEET_DATABASE_URL",
    metavar="URL",
    help="SQLAlchemy URL of the Postgres database (env RLFLEET_DATABASE_URL).",
)
@click.option(
    "--nats-url",
    envvar="RLFLEET_NATS_URL",
    metavar="URL[,URL…]",
    help="NATS server(s), comma-separated (env RLFLEET_NATS_URL).",
)
@click.option(
    "--log-level",
    envvar="RLFLEET_LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Log verbosity, logs go to stderr (default: WARNING for commands, INFO for daemons).",
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
    ctx.obj = CliContext(Settings.load(database_url, nats_url), level)


def _register() -> None:
    from scheduler.cli import daemons, db, job, vm

    for module in (db, vm, job):
        cli.add_command(module.group)
    for command in daemons.COMMANDS:
        cli.add_command(command)


_register()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    sys.exit(run_guarded(cli, argv))
