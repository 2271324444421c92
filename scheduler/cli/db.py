"""`rlfleet db …`: schema migrations."""

from __future__ import annotations

import click
from alembic.util.exc import CommandError
from sqlalchemy.exc import OperationalError

from scheduler import migrate
from scheduler.cli._common import CliContext, ColumnText, echo_json, json_option, pass_cli
from scheduler.errors import BadInput, error_line
from scheduler.validate import shown


@click.group("db")
def group() -> None:
    """Create or upgrade the database schema (Alembic migrations)."""


@group.command("upgrade")
@click.option(
    "--revision", default="head", show_default=True, type=ColumnText(), help="Target revision."
)
@pass_cli
def upgrade(ctx: CliContext, revision: str) -> None:
    """Apply every migration up to REVISION (safe to run again)."""
    try:
        url = ctx.database_url
        migrate.upgrade(url, revision)
        now = migrate.current_revision(url)
    except OperationalError as exc:
        raise ctx.database_unreachable(exc) from exc
    except CommandError as exc:  # no such revision, or not one ahead of the database
        raise BadInput(f"cannot upgrade to {shown(revision)}: {error_line(exc)}") from exc
    click.echo(f"database at revision {now}")


@group.command("current")
@json_option
@pass_cli
def current(ctx: CliContext, as_json: bool) -> None:
    """Show the database's revision and whether it is up to date."""
    try:
        url = ctx.database_url
        now = migrate.current_revision(url)
    except OperationalError as exc:
        raise ctx.database_unreachable(exc) from exc
    head = migrate.head_revision(url)
    if as_json:
        echo_json({"current": now, "head": head, "up_to_date": now == head})
        return
    state = "up to date" if now == head else f"behind head {head}: run `rlfleet db upgrade`"
    click.echo(f"{now or '(empty database)'} ({state})")
