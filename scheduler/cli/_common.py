"""What every CLI command shares: settings, async running, errors and output."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import click

from scheduler.db import Database, is_unavailable
from scheduler.errors import RlfleetError, ServiceUnavailable, error_line
from scheduler.logging import configure
from scheduler.redact import redact_url, scrub_urls
from scheduler.settings import Settings

T = TypeVar("T")


@dataclass
class CliContext:
    """Passed to every command as `ctx.obj`."""

    settings: Settings
    log_level: str = "INFO"

    def run(self, fn: Callable[[Database], Awaitable[T]]) -> T:
        """Run `fn(db)` on a fresh event loop with a database of its own."""
        configure(self.log_level)

        async def go() -> T:
            db = Database(self.settings.database_url, pool_size=2)
            try:
                return await fn(db)
            except Exception as exc:
                if is_unavailable(exc):
                    raise self.database_unreachable(exc) from exc
                raise
            finally:
                await db.dispose()

        return asyncio.run(go())

    def database_unreachable(self, exc: BaseException) -> ServiceUnavailable:
        """The one-line error for a database that cannot be used (password redacted)."""
        url = redact_url(self.settings.database_url)
        return ServiceUnavailable(f"cannot reach the database at {url}: {error_line(exc)}")

    def run_coro(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine that needs no database handle."""
        configure(self.log_level)
        return asyncio.run(coro)


pass_cli = click.make_pass_decorator(CliContext)


def run_guarded(command: click.Command, argv: Sequence[str] | None) -> int:
    """Run the click command; turn every expected error into one line and an exit code."""
    try:
        command.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 1
    except click.ClickException as exc:
        click.echo(f"Error: {scrub_urls(exc.format_message())}", err=True)
        return exc.exit_code
    except RlfleetError as exc:
        # Libraries quote URLs back in their errors: never print a credential.
        click.echo(f"Error: {scrub_urls(str(exc))}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def to_jsonable(value: Any) -> Any:
    """Datetimes as ISO strings, everything else unchanged, recursively."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value


def echo_json(value: Any) -> None:
    """Print `value` as indented JSON on stdout."""
    click.echo(json.dumps(to_jsonable(value), indent=2, sort_keys=False))


def fmt_time(value: datetime | None) -> str:
    """A timestamp for tables: local time to the second, or '-'."""
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def echo_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table, like `squeue`."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The `--json` flag every listing takes."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def warn(message: str) -> None:
    """One warning line on stderr."""
    click.echo(f"Warning: {message}", err=True)


def stdout_is_tty() -> bool:
    """Whether stdout is a terminal."""
    return sys.stdout.isatty()
