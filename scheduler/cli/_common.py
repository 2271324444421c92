"""What every CLI command shares: settings, async running, errors, output, and the options
several commands take."""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import click

from scheduler.errors import BadInput, RlfleetError, ServiceUnavailable, error_line
from scheduler.redact import redact_url, scrub_urls
from scheduler.settings import Settings
from scheduler.upfind import WAY_OUT
from scheduler.validate import (
    INTEGER_RE,
    check_argv,
    check_database_url,
    check_int,
    check_nats_url,
    check_seconds,
    check_text,
    parse_job_id,
    shown,
)

if TYPE_CHECKING:
    from scheduler.db import Database
    from scheduler.pgconn import PgDatabase
    from scheduler.upfind import FoundUp

# asyncio, the database layer (SQLAlchemy, psycopg) and structlog are imported when a
# command uses them, not here: `rlfleet --help` and `--version` load none of them.

T = TypeVar("T")


class _Disposable(Protocol):
    """A command's database handle (`Database`, `pgconn.PgDatabase`)."""

    async def dispose(self) -> None:
        """Close its connections."""


D = TypeVar("D", bound=_Disposable)


COMMAND_LOG_LEVEL = "WARNING"
"""Log level of the one-shot commands unless --log-level / RLFLEET_LOG_LEVEL says otherwise:
a command that succeeds prints nothing on stderr."""


@dataclass
class CliContext:
    """Passed to every command as `ctx.obj`."""

    database_flag: str | None
    nats_flag: str | None
    log_level: str | None = None
    """As given (--log-level, RLFLEET_LOG_LEVEL); None: WARNING for commands, INFO for daemons."""
    _resolved: tuple[Settings, FoundUp | None, bool] | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        """The flags' and environment's settings, else a running `rlfleet up`'s (found on
        first use, so that `--help` works whatever the state directory holds)."""
        if self._resolved is None:
            from scheduler.upfind import cli_settings

            self._resolved = cli_settings(self.database_flag, self.nats_flag)
        return self._resolved[0]

    def way_out(self) -> str:
        """What a connection error adds: the `up` whose settings were used, or how to
        point the command at a database when none was configured or found."""
        self.settings  # noqa: B018 - resolves them
        assert self._resolved is not None
        _, found, configured = self._resolved
        if found is not None:
            return f" (the `rlfleet up` in {found.state_dir})"
        return "" if configured else f"; {WAY_OUT}"

    @property
    def database_url(self) -> str:
        """The database URL, checked before any use (malformed: `BadInput`, exit 2)."""
        return check_database_url(self.settings.database_url)

    def run(self, fn: Callable[[Database], Awaitable[T]], *, nats: bool = False) -> T:
        """Run `fn(db)` on a fresh event loop with a database of its own; with `nats`, the
        NATS URL is checked first too. Nothing is touched before both are known sane."""
        from scheduler.db import Database, is_unavailable

        return self._run(lambda url: Database(url, pool_size=2), is_unavailable, fn, nats)

    def run_sql(self, fn: Callable[[PgDatabase], Awaitable[T]], *, nats: bool = False) -> T:
        """`run`, with a plain psycopg connection (`pgconn.PgDatabase`) for the statements
        of `scheduler.jobstore` instead of a `Database`: no SQLAlchemy is loaded, so the
        commands that need nothing else (`job list`, `job submit`) start fast."""
        from scheduler.pgconn import PgDatabase, is_unavailable

        return self._run(PgDatabase, is_unavailable, fn, nats)

    def _run(
        self,
        open_db: Callable[[str], D],
        is_unavailable: Callable[[BaseException], bool],
        fn: Callable[[D], Awaitable[T]],
        nats: bool,
    ) -> T:
        """`fn(open_db(url))` on a fresh event loop, the database disposed of after; an
        error saying the database cannot be used is one line, its URL redacted."""
        import asyncio

        from scheduler.logging import configure

        url = self.database_url
        if nats:
            check_nats_url(self.settings.nats_url)
        configure(self.log_level or COMMAND_LOG_LEVEL)

        async def go() -> T:
            db = open_db(url)
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
        return ServiceUnavailable(
            f"cannot reach the database at {url}: {error_line(exc)}{self.way_out()}"
        )

    def run_coro(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine that needs no database handle."""
        import asyncio

        from scheduler.logging import configure

        configure(self.log_level or COMMAND_LOG_LEVEL)
        return asyncio.run(coro)


pass_cli = click.make_pass_decorator(CliContext)


def run_guarded(command: click.Command, argv: Sequence[str] | None) -> int:
    """Run the click command; turn every expected error into one line and an exit code."""
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        check_argv(args)
        command.main(args=args, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 1
    except click.ClickException as exc:
        click.echo(one_line(f"Error: {scrub_urls(exc.format_message())}"), err=True)
        return exc.exit_code
    except RlfleetError as exc:
        # Libraries quote URLs back in their errors: never print a credential.
        click.echo(one_line(f"Error: {scrub_urls(str(exc))}"), err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


class ColumnInt(click.ParamType):
    """An integer option or argument that must fit its column's type (and [lo, hi]), so that
    `--gpus 2147483648` is exit 2 and one line, not an error from the database."""

    name = "integer"

    def __init__(
        self,
        column: Any = None,
        *,
        lo: int | None = None,
        hi: int | None = None,
        bounds: tuple[int, int] | None = None,
    ):
        self.column, self.lo, self.hi, self.bounds = column, lo, hi, bounds

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """Parse and range-check one value."""
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            # ASCII digits only: `int` also reads `٤` as 4.
            if not INTEGER_RE.fullmatch(text):
                self.fail(f"{shown(str(value))} is not a valid integer", param, ctx)
            number = int(text, 10)
        try:
            return check_int(
                number, "it", column=self.column, lo=self.lo, hi=self.hi, bounds=self.bounds
            )
        except BadInput as exc:
            self.fail(str(exc).removeprefix("it "), param, ctx)


class JobId(click.ParamType):
    """A job id: ASCII digits only, 1 to 2**63 - 1 (`validate.parse_job_id`)."""

    name = "job_id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """Parse one job id."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        try:
            return parse_job_id(str(value))
        except BadInput as exc:
            self.fail(str(exc), param, ctx)


class ColumnText(click.ParamType):
    """A text option or argument that must fit its column (length, UTF-8, no NUL)."""

    name = "text"

    def __init__(self, column: Any = None, *, max_len: int | None = None, empty_ok: bool = False):
        self.column, self.max_len, self.empty_ok = column, max_len, empty_ok

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        """Check one value."""
        try:
            return check_text(
                str(value), "it", column=self.column, max_len=self.max_len, empty_ok=self.empty_ok
            )
        except BadInput as exc:
            self.fail(str(exc).removeprefix("it "), param, ctx)


class Seconds(click.ParamType):
    """A duration in seconds: finite, not negative, at most a day."""

    name = "seconds"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        """Parse and range-check one value."""
        try:
            return check_seconds(float(value), "it")
        except ValueError:
            self.fail(f"{shown(str(value))} is not a number", param, ctx)
        except BadInput as exc:
            self.fail(str(exc).removeprefix("it "), param, ctx)


_SIZE_RE = re.compile(r"([0-9]{1,19})(?:\.([0-9]{1,6}))?\s*([KMGTkmgt](?:i?[Bb])?)?")


class ByteSize(click.ParamType):
    """`--max-size`: bytes, or a number with K/M/G/T (KiB…, binary) or KB/MB/GB/TB
    (decimal); at least 1 byte, at most 2**62."""

    name = "size"
    _UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
              "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """Parse one size."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip()
        match = _SIZE_RE.fullmatch(text)
        unit = (match.group(3) or "").lower().replace("ib", "") if match else ""
        if match is None or unit not in self._UNITS:
            self.fail(f"{shown(text)} is not a size (e.g. 500M, 10G, 1000000)", param, ctx)
        whole, frac = match.group(1), match.group(2) or "0"
        size = (int(whole) * self._UNITS[unit]) + int(frac) * self._UNITS[unit] // 10 ** len(frac)
        if not 1 <= size <= 1 << 62:
            self.fail(f"{shown(text)} is out of range (1 byte to 4 EiB)", param, ctx)
        return size


def one_line(message: str) -> str:
    """`message` on one printable line: a value the user typed may hold a newline, a
    carriage return or bytes that were not UTF-8, and the line must stay one line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)


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


def printable(value: Any) -> str:
    """`value` as text a terminal shows as it is: control characters (ESC, CR…), bidi
    overrides and other format characters escaped (`\\x1b`, `\\u202e`), so a name a user
    typed can neither move the cursor, recolour the screen nor reorder what follows.
    `--json` prints the exact value."""
    text = str(value)
    if text.isprintable() and text.isascii():
        return text
    return "".join(
        ch if ch == " " or unicodedata.category(ch) not in _UNSHOWN else _escaped(ch) for ch in text
    )


_UNSHOWN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _escaped(ch: str) -> str:
    code = ord(ch)
    if ch in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def echo_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table, like `squeue` (every cell `printable`)."""
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else printable(c) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


# --- options several commands take: one definition each ---------------------------------
# A command that takes one of these options declares it through the factory below, so that
# its flag, environment variable, type and default cannot drift from the other commands';
# only the help may say what the option means for that command
# (tests/unit/test_cli_options.py checks that every shared flag is declared alike).

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def database_url_option(help: str) -> Decorator:
    """`--database-url URL` (env RLFLEET_DATABASE_URL)."""
    return click.option("--database-url", envvar="RLFLEET_DATABASE_URL", metavar="URL", help=help)


def nats_url_option(help: str) -> Decorator:
    """`--nats-url URL[,URL…]` (env RLFLEET_NATS_URL)."""
    return click.option("--nats-url", envvar="RLFLEET_NATS_URL", metavar="URL[,URL…]", help=help)


def log_level_option(help: str) -> Decorator:
    """`--log-level` (env RLFLEET_LOG_LEVEL), any case; None when not given."""
    return click.option(
        "--log-level",
        envvar="RLFLEET_LOG_LEVEL",
        default=None,
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        help=help,
    )


def state_dir_option(help: str) -> Decorator:
    """`--state-dir DIRECTORY` (a `Path`; None when not given: the commands default to the
    state directory of `rlfleet up`)."""
    return click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help=help,
    )


def json_flag(help: str = "Print JSON for scripts.") -> Decorator:
    """`--json` (the parameter `as_json`): print JSON instead of text."""
    return click.option("--json", "as_json", is_flag=True, help=help)


json_option = json_flag()
"""The `--json` flag every listing takes."""


def warn(message: str) -> None:
    """One warning line on stderr."""
    click.echo(one_line(f"Warning: {message}"), err=True)


def stdout_is_tty() -> bool:
    """Whether stdout is a terminal."""
    return sys.stdout.isatty()
