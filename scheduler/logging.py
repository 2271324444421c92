"""structlog set up once: JSON lines when not on a terminal, readable console when on one."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from scheduler.redact import scrub_urls

_configured = False


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
    global _configured
    if _configured:
        return
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ScrubFilter())
    for noisy in ("asyncssh", "nats", "alembic", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
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
    _configured = True


def get_logger(name: str | None = None, **bound: object) -> structlog.stdlib.BoundLogger:
    """A structlog logger, bound to `component=name` and any extra context."""
    # Initial values, not .bind(): bind() on the lazy proxy builds the logger at once, so a
    # module-level logger would keep structlog's defaults and ignore `configure`.
    initial = {"component": name, **bound} if name else bound
    return structlog.get_logger(**initial)  # type: ignore[no-any-return]
