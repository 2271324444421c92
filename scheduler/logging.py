"""structlog set up once: JSON lines when not on a terminal, readable console when on one.

structlog itself (and the `rich` it loads for tracebacks when installed) is imported when a
logger first logs, not when a module creates its logger: a one-shot command that logs
nothing (`job submit` publishes through `scheduler.bus`) does not pay for it."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, cast

from scheduler.redact import scrub_urls

if TYPE_CHECKING:
    import structlog

_configured = False
_wanted: tuple[str, bool] | None = None
"""The level and format `configure` asked for, applied to structlog once it is loaded."""
_applied = False


def _scrub_event(
    _logger: object, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Redact URLs and known secrets in every string of a log event
    (docs/invariants.md, invariant 7)."""
    return {k: scrub_urls(v) if isinstance(v, str) else v for k, v in event.items()}


class _ScrubFilter(logging.Filter):
    """The same for stdlib log records (asyncssh, nats, alembic, sqlalchemy)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = scrub_urls(record.getMessage())
        record.args = None
        return True


def configure(level: str = "INFO", *, json: bool | None = None) -> None:
    """Configure structlog and stdlib logging for the whole process (idempotent)."""
    global _configured, _wanted
    if _configured:
        return
    if json is None:
        json = not sys.stderr.isatty()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ScrubFilter())
    for noisy in ("asyncssh", "nats", "alembic", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _wanted = (level, json)
    _configured = True
    if "structlog" in sys.modules:
        _structlog()


def _structlog() -> Any:
    """structlog, imported and configured as `configure` asked (if it was called)."""
    global _applied
    import structlog

    if _wanted is None or _applied:
        return structlog
    level, json = _wanted
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _scrub_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _applied = True
    return structlog


def _below_level(method: str) -> bool:
    """Whether `configure` set a level that drops events of the logging method `method`."""
    if _wanted is None:
        return False
    level = logging.getLevelName(method.upper())
    return isinstance(level, int) and level < logging.getLevelName(_wanted[0].upper())


def _drop(*_args: object, **_values: object) -> None:
    """A filtered-out event."""


class _LazyLogger:
    """A structlog logger created, structlog imported, at its first use."""

    def __init__(self, initial: dict[str, object]) -> None:
        self._initial = initial
        self._logger: Any = None

    def bind(self, **values: object) -> _LazyLogger:
        """A logger with more context, itself created at its first use."""
        if self._logger is not None:
            return cast(_LazyLogger, self._logger.bind(**values))
        return _LazyLogger({**self._initial, **values})

    def __getattr__(self, name: str) -> Any:
        if self._logger is None and _below_level(name):
            return _drop  # what structlog would filter out: no need to load it
        if self._logger is None:
            self._logger = _structlog().get_logger(**self._initial)
        return getattr(self._logger, name)


def get_logger(name: str | None = None, **bound: object) -> structlog.stdlib.BoundLogger:
    """A structlog logger, bound to `component=name` and any extra context."""
    # Initial values, not .bind(): bind() on the lazy proxy builds the logger at once, so a
    # module-level logger would keep structlog's defaults and ignore `configure`.
    initial = {"component": name, **bound} if name else bound
    return cast("structlog.stdlib.BoundLogger", _LazyLogger(initial))
