"""Errors users see. Each one's message is a single line; the CLI prints it and exits."""

from __future__ import annotations


class RlfleetError(Exception):
    """Base of the errors the CLI turns into one line on stderr."""

    exit_code = 1


class BadInput(RlfleetError):
    """The user asked for something invalid; nothing was changed (exit 2)."""

    exit_code = 2


class NotFound(BadInput):
    """No such VM or job (exit 2)."""


class ServiceUnavailable(RlfleetError):
    """Postgres, NATS or a VM could not be reached (exit 1)."""


def error_line(exc: BaseException, limit: int = 300) -> str:
    """One line saying what went wrong: the first line of the error's own message (for a
    database error, the driver's: SQLAlchemy's text ends with a link to its docs), or the
    error's type when it has no message."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]
